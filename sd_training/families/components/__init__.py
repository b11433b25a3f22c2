"""Shared parts that families compose: objectives, text encoders, the UNet and transformer builders."""
