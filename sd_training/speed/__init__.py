"""Speed levers and their measure: precision, compile and its cache, fp8, host syncs, FLOPs and MFU."""
