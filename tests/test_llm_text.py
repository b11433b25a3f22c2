"""The LLM text-encoder component (components/llm_text.py) against the diffusers pipelines it stands for, with the
offline tiny tokenizers (components/llm_tokenizers.py) and tiny random LLMs: Qwen3's chat template as the
pipelines call it, FLUX.2 klein's stacked Qwen3 layers, FLUX.2 dev's Mistral-3 processor with its system
message, Qwen-Image's format-string template with its prefix dropped and its mask; and the stored layout (the
mask as a last channel). Z-Image's own checks: test_zimage.py."""

from functools import partial
from types import SimpleNamespace

import pytest
import torch

from sd_training.families.components import llm_text
from sd_training.families.components.llm_tokenizers import tiny_mistral3, tiny_qwen3

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPTS = ["a red circle on a blue background", "", "a yellow triangle " * 12, "a cat [IMG] and <|endoftext|>"]


@pytest.fixture(scope="module")
def qwen_tokenizer(tmp_path_factory):
    return llm_text.build_qwen_tokenizer(tmp_path_factory.mktemp("qwen_tokenizer"))


@pytest.fixture(scope="module")
def qwen3(qwen_tokenizer):
    torch.manual_seed(0)
    return tiny_qwen3(len(qwen_tokenizer), causal_lm=True, num_hidden_layers=3).eval()


def test_the_chat_template_is_qwen3s_as_the_pipelines_call_it(qwen_tokenizer):
    """enable_thinking=True (Z-Image) writes no think block, False (FLUX.2 klein) the empty one; a format string
    (Qwen-Image's kind) replaces the template; control tokens are one id each; captions tokenize whatever they hold."""
    tok = qwen_tokenizer
    thinking = llm_text.render(tok, "a cat", llm_text.LLMTextSettings((-2,), 8, 8, enable_thinking=True))
    assert thinking == "<|im_start|>user\na cat<|im_end|>\n<|im_start|>assistant\n"
    no_think = llm_text.render(tok, "a cat", llm_text.LLMTextSettings((-2,), 8, 8, enable_thinking=False))
    assert no_think == thinking + "<think>\n\n</think>\n\n"
    assert llm_text.render(tok, "a cat", llm_text.LLMTextSettings((1,), 8, 8, template="<s>{}</s>")) == "<s>a cat</s>"
    ids = tok(thinking).input_ids
    assert tok.convert_ids_to_tokens(ids)[0] == "<|im_start|>" and tok.decode(ids) == thinking
    assert tok.decode(tok("Ünïcode ✓ 42").input_ids) == "Ünïcode ✓ 42"  # byte-level: nothing unknown


def test_stacked_layers_equal_flux2_klein_prompt_embeds(qwen_tokenizer, qwen3):
    """Several layers side by side per token, every padded token kept (no mask), equal
    Flux2KleinPipeline._get_qwen3_prompt_embeds for the same Qwen3 and tokenizer, a cut prompt included."""
    from diffusers import Flux2KleinPipeline

    settings = llm_text.LLMTextSettings(layers=(1, 2, 3), max_length=24, limit=512, enable_thinking=False)
    tok = llm_text.PromptTokenizer(qwen_tokenizer, settings)
    got = llm_text.encode_llm(qwen3, tok(PROMPTS).input_ids, tok.pad_token_id, settings)
    with torch.no_grad():
        want = Flux2KleinPipeline._get_qwen3_prompt_embeds(qwen3, qwen_tokenizer, PROMPTS, max_sequence_length=24,
                                                           hidden_states_layers=(1, 2, 3))
    assert got.mask is None and got.states.shape == want.shape == (len(PROMPTS), 24, 3 * qwen3.config.hidden_size)
    assert torch.equal(got.states, want.float())


def test_mistral3_processor_equals_flux2_dev_prompt_embeds(tmp_path):
    """FLUX.2 dev's settings (system message, text parts, the BOS from the template, [IMG] removed, left padding
    as Mistral's) through the tiny Mistral-3 processor equal Flux2Pipeline._get_mistral_3_small_prompt_embeds."""
    from diffusers import Flux2Pipeline

    processor = llm_text.build_mistral3_processor(tmp_path / "processor")
    system = "Describe the image."  # short: the prompts fit the tokens
    settings = llm_text.LLMTextSettings(layers=(1, 2), max_length=96, limit=512, system=system, content_parts=True,
                                        add_special_tokens=False, generation_prompt=False, strip=("[IMG]",))
    want = f"<s>[SYSTEM_PROMPT]{system}[/SYSTEM_PROMPT][INST]a cat[/INST]"
    assert llm_text.render(processor, "a [IMG]cat", settings) == want
    torch.manual_seed(0)
    encoder = tiny_mistral3(len(processor.tokenizer)).eval()
    tok = llm_text.PromptTokenizer(processor, settings)
    ids = tok(PROMPTS).input_ids
    assert processor.tokenizer.padding_side == "left" and (ids[:, 0] == llm_text.PAD).any()
    got = llm_text.encode_llm(encoder, ids, tok.pad_token_id, settings)
    with torch.no_grad():
        want = Flux2Pipeline._get_mistral_3_small_prompt_embeds(encoder, processor, PROMPTS, max_sequence_length=96,
                                                                system_message=system, hidden_states_layers=(1, 2))
    assert got.states.shape == want.shape == (len(PROMPTS), 96, 2 * 32)
    assert torch.equal(got.states, want.float())


def test_format_template_and_dropped_prefix_equal_qwen_image_prompt_embeds(qwen_tokenizer, qwen3):
    """Qwen-Image's way (a format string, max_length + the prefix tokenized, the last layer, the prefix dropped,
    real tokens with a mask) equals QwenImagePipeline._get_qwen_prompt_embeds on the same LLM (a Qwen3 standing in
    for Qwen2.5-VL: the same hidden-states interface), the prefix's token count taken from this tokenizer."""
    from diffusers import QwenImagePipeline

    template = QwenImagePipeline.__init__.__code__.co_consts  # the template is set in __init__: read it from there
    template = next(c for c in template if isinstance(c, str) and c.startswith("<|im_start|>system"))
    drop = len(qwen_tokenizer(template.split("{}")[0]).input_ids)
    settings = llm_text.LLMTextSettings(layers=(-1,), max_length=16, limit=1024, template=template, drop_prefix=drop,
                                        masked=True)
    tok = llm_text.PromptTokenizer(qwen_tokenizer, settings)
    got = llm_text.encode_llm(qwen3, tok(PROMPTS).input_ids, tok.pad_token_id, settings)
    fake = SimpleNamespace(prompt_template_encode=template, prompt_template_encode_start_idx=drop,
                           tokenizer_max_length=16, tokenizer=qwen_tokenizer, text_encoder=qwen3,
                           _execution_device=torch.device("cpu"))
    fake._extract_masked_hidden = partial(QwenImagePipeline._extract_masked_hidden, fake)
    with torch.no_grad():
        want, want_mask = QwenImagePipeline._get_qwen_prompt_embeds(fake, PROMPTS, device=torch.device("cpu"))
    assert got.states.shape[1] == 16 and got.mask.sum(1).tolist() == want_mask.sum(1).tolist()
    for states, mask, w, m in zip(got.states, got.mask, want, want_mask.bool()):
        assert torch.equal(states[mask], w[m].float())


def test_the_mask_is_stored_as_a_last_channel():
    """with_mask / split_mask round-trip exactly; an unmasked conditioning is stored as it is."""
    states, mask = torch.randn(2, 5, 3), torch.tensor([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.bool)
    stored = llm_text.with_mask(llm_text.TextConditioning(states, None, mask))
    assert stored.shape == (2, 5, 4)
    assert llm_text.stored_width(3, llm_text.LLMTextSettings((1,), 5, 5, masked=True)) == 4
    back, back_mask = llm_text.split_mask(stored.bfloat16().float(), True)  # 0 / 1 are exact in bf16
    assert torch.equal(back_mask, mask) and torch.equal(back, states.bfloat16().float())
    assert [len(t) for t in llm_text.real_tokens(states, mask)] == [3, 1]
    assert llm_text.with_mask(llm_text.TextConditioning(states, None, None)) is states
    assert llm_text.split_mask(states, False) == (states, None)


def test_lengths_over_the_pipelines_limit_are_refused():
    settings = llm_text.LLMTextSettings((-2,), 512, 992)
    assert llm_text.check_length(None, settings, "--max-length", "ZImagePipeline") == 512
    with pytest.raises(ValueError, match="--max-length: ZImagePipeline takes at most 992"):
        llm_text.check_length(993, settings, "--max-length", "ZImagePipeline")
