"""Hugging Face Llama and Qwen2 in: rose's logits and greedy tokens equal transformers' on
the same weights; and rose's Llama-shaped models out, which transformers loads.

No weights can be downloaded here, so randomly initialised LlamaForCausalLM and
Qwen2ForCausalLM models of odd shapes (grouped 4:1, 3:1, one key/value head; tied and
untied; rotary bases other than 10,000) are saved with save_pretrained and loaded back
by rose. A large initializer_range makes every weight matter to the logits (and gives
clear greedy margins), so a wrong join, split or head order cannot hide.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from models import assert_clear_margins, assert_logits_close, write_random_checkpoint

from roseinfer.cache.dense import StaticKVCache
from roseinfer.cli.export_hf import main as export_main
from roseinfer.loops.generate import generate
from roseinfer.request.sampling import SamplingParams
from rosetrainer.config import GPTConfig
from rosetrainer.errors import RoseError
from rosetrainer.hf import config_from_hf, load_hf, read_hf_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 320
NEW_TOKENS = 20
# name -> (model type, query heads, key/value heads, tied, rope_theta)
SHAPES = {
    "llama-4:1-untied": ("llama", 4, 1, False, 500.0),
    "llama-3:1-tied": ("llama", 6, 2, True, 100000.0),
    "qwen2-3:1-one-kv-head": ("qwen2", 3, 1, False, 1000000.0),
    "qwen2-2:1-tied": ("qwen2", 4, 2, True, 10000.0),
}


def hf_model_of(shape: str):  # noqa: ANN201 (a transformers model)
    import transformers

    model_type, n_head, n_kv_head, tied, theta = SHAPES[shape]
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(
        model_type,
        vocab_size=VOCAB,
        hidden_size=8 * n_head,
        intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=n_head,
        num_key_value_heads=n_kv_head,
        max_position_embeddings=64,
        rope_theta=theta,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tied,
        initializer_range=0.3,
    )
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # RMSNorm weights start at 1.0: make them matter too
        for name, param in model.named_parameters():
            if name.endswith(("norm.weight", "proj.bias")):
                param.uniform_(0.5, 1.5)
    return model


@pytest.fixture(scope="module", params=list(SHAPES))
def pair(request, tmp_path_factory):
    """(the transformers model, its save_pretrained folder)."""
    hf_model = hf_model_of(request.param)
    folder = tmp_path_factory.mktemp(request.param)
    hf_model.save_pretrained(folder)
    return hf_model, folder


def prompt_ids() -> list[int]:
    return [3, 141, 59, 26, 300, 8, 97]


def test_the_config_is_read_into_the_llama_shaped_choices(pair) -> None:
    hf_model, folder = pair
    hf = hf_model.config
    config = config_from_hf(read_hf_config(str(folder)))
    assert (config.n_head, config.kv_heads) == (hf.num_attention_heads, hf.num_key_value_heads)
    assert (config.norm, config.mlp, config.position_embedding) == ("rmsnorm", "swiglu", "rotary")
    assert config.rotary_base == hf.rope_parameters["rope_theta"]
    assert config.tie_embeddings == hf.tie_word_embeddings
    assert config.qkv_bias == (hf.model_type == "qwen2")


def test_logits_equal_transformers(pair) -> None:
    hf_model, folder = pair
    model = load_hf(str(folder)).eval()
    tokens = torch.randint(VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert_logits_close(model(tokens).logits, hf_model(tokens).logits)


def test_greedy_tokens_equal_transformers_uncached_and_cached(pair) -> None:
    hf_model, folder = pair
    model = load_hf(str(folder)).eval()
    params = SamplingParams(max_tokens=NEW_TOKENS)
    oracle = generate(model, prompt_ids(), params, use_cache=False, keep_logits=True)
    assert_clear_margins(oracle.step_logits)
    with torch.no_grad():
        hf_out = hf_model.generate(
            torch.tensor([prompt_ids()]),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )
    assert oracle.token_ids == hf_out[0, len(prompt_ids()) :].tolist()
    cache = StaticKVCache(model, 1, len(prompt_ids()) + NEW_TOKENS)
    assert generate(model, prompt_ids(), params, cache=cache).token_ids == oracle.token_ids


def test_a_tied_folder_with_an_untied_head_is_refused(tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    hf_model = hf_model_of("llama-3:1-tied")
    hf_model.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"] + 1.0
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(RoseError, match="lm_head.weight differs from the token embedding"):
        load_hf(str(tmp_path))


@pytest.mark.parametrize(
    "edit, said",
    [
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"mlp_bias": True}, "mlp_bias=True"),
        ({"attention_bias": True}, "attention_bias=True"),
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}}, "scales its rotary"),
        ({"head_dim": 16}, "head_dim 16"),
    ],
)
def test_variants_rose_does_not_compute_are_refused(tmp_path, edit, said) -> None:
    hf_model_of("llama-4:1-untied").save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **edit}))
    with pytest.raises(RoseError) as info:
        load_hf(str(tmp_path))
    assert said in str(info.value)


# ---------------------------------------------------------------------------
# Out: rose-export-hf writes a Llama-shaped checkpoint as a Llama (or Qwen2) folder
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "choices",
    [
        dict(n_kv_head=1, tie_embeddings=True, rotary_base=500.0),
        dict(n_kv_head=2, tie_embeddings=False, qkv_bias=True),
    ],
    ids=["llama-tied", "qwen2-untied"],
)
@pytest.mark.slow
def test_an_exported_llama_shaped_checkpoint_runs_in_transformers(tmp_path, choices) -> None:
    from transformers import AutoModelForCausalLM

    config = GPTConfig.from_preset(
        "tiny-llama", n_layer=2, n_embd=32, mlp_hidden=48, block_size=64, **choices
    )
    checkpoint = write_random_checkpoint(tmp_path / "run.pt", config)
    assert export_main(["--checkpoint-path", str(checkpoint), "--out", str(tmp_path / "hf")]) == 0
    folder = tmp_path / "hf"
    written = json.loads((folder / "config.json").read_text())
    assert written["model_type"] == ("qwen2" if choices.get("qkv_bias") else "llama")
    hf_model = AutoModelForCausalLM.from_pretrained(folder).eval()
    rose_model = load_hf(str(folder)).eval()  # rose reads it back (the CLI checked: the same)
    prompt = [464, 3290, 318, 257, 1332]  # GPT-2 ids: the checkpoint's tokenizer
    params = SamplingParams(max_tokens=NEW_TOKENS)
    oracle = generate(rose_model, prompt, params, use_cache=False, keep_logits=True)
    assert_clear_margins(oracle.step_logits)
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None
        )
        tokens = torch.tensor([prompt + oracle.token_ids])
        assert_logits_close(rose_model(tokens).logits, hf_model(tokens).logits)
    assert out[0, len(prompt) :].tolist() == oracle.token_ids


def test_a_model_neither_format_computes_is_refused(tmp_path, capsys) -> None:
    config = GPTConfig.from_preset(
        "tiny-llama", n_layer=1, n_embd=32, block_size=32, sliding_window=8
    )
    checkpoint = write_random_checkpoint(tmp_path / "run.pt", config)
    assert export_main(["--checkpoint-path", str(checkpoint), "--out", str(tmp_path / "hf")]) == 2
    said = capsys.readouterr().err.strip()
    assert said.endswith("sliding_window=None, so the model cannot be exported as either")
    assert len(said.splitlines()) == 1 and not (tmp_path / "hf").exists()


# ---------------------------------------------------------------------------
# Served: rose-serve --hf-model on a Llama folder, its own tokenizer and chat template
# ---------------------------------------------------------------------------

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)  # SmolLM2's and Qwen2's format


def llama_folder_with_tokenizer(folder: Path) -> None:
    """A random Llama (4:1, untied) and a byte-level BPE trained here on a few lines, its
    vocabulary the model's, with a ChatML template and <|im_end|> ending a turn."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    text = ["But, soft! what light through yonder window breaks?", "Who is Romeo?"] * 20
    tokenizer.train_from_iterator(text, trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    settings = {"eos_token": "<|im_end|>", "chat_template": CHATML, "bos_token": None}
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    torch.manual_seed(3)
    config = transformers.LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=32,
        intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=256,
        rope_theta=500.0,
        initializer_range=0.3,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(folder)


def test_llm_chat_renders_with_a_llama_folders_own_template_as_transformers(tmp_path) -> None:
    from transformers import AutoTokenizer

    from roseinfer import LLM, SamplingParams

    folder = tmp_path / "llama"
    folder.mkdir()
    llama_folder_with_tokenizer(folder)
    messages = [{"role": "user", "content": "Who is Romeo?"}]
    hf_tokenizer = AutoTokenizer.from_pretrained(folder)
    text = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    llm = LLM(str(folder), device="cpu")
    (output,) = llm.chat(messages, SamplingParams(max_tokens=4), use_tqdm=False)
    assert output.prompt == text
    assert output.prompt_token_ids == hf_tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.mark.slow
def test_rose_serve_chats_with_a_llama_folders_own_template_as_transformers(tmp_path) -> None:
    import openai
    from servers import API_KEY, running_server
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tmp_path / "llama"
    folder.mkdir()
    llama_folder_with_tokenizer(folder)
    messages = [{"role": "user", "content": "Who is Romeo?"}]
    # The reference, all transformers: its tokenizer renders the template, its model decodes.
    hf_tokenizer = AutoTokenizer.from_pretrained(folder)
    text = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nWho is Romeo?<|im_end|>\n<|im_start|>assistant\n"
    prompt = hf_tokenizer(text, add_special_tokens=False)["input_ids"]
    hf_model = AutoModelForCausalLM.from_pretrained(folder).eval()
    eos = hf_tokenizer.convert_tokens_to_ids("<|im_end|>")
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=eos
        )[0, len(prompt) :].tolist()
    stopped = eos in out
    assert len(out) >= 6, "the reference stops at once: a weak check (pick another seed)"
    want = hf_tokenizer.decode(out[: out.index(eos)] if stopped else out)
    with running_server(
        folder, tmp_path / "server.log", "--api-key", API_KEY, source_flag="--hf-model"
    ) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key=API_KEY)
        reply = client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=12, temperature=0
        )
    assert reply.choices[0].message.content == want
    assert reply.choices[0].finish_reason == ("stop" if stopped else "length")
    assert reply.usage.prompt_tokens == len(prompt)


def test_rose_generate_runs_a_llama_folder_with_its_tokenizer_and_a_split_is_refused(
    tmp_path, capsys
) -> None:
    """rose-generate --hf-model: the folder's own tokenizer encodes the prompt and decodes the
    tokens, which are transformers' greedy ones; the split model (tiktoken tokenizers only)
    says so in one line."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from roseinfer.cli.generate import main as generate_main

    llama_folder_with_tokenizer(tmp_path)
    hf_tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    prompt = hf_tokenizer("Who is Romeo?", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        out = (
            AutoModelForCausalLM.from_pretrained(tmp_path)
            .generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False)[0, len(prompt) :]
            .tolist()
        )
    common = ["--hf-model", str(tmp_path), "--prompt", "Who is Romeo?", "--max-new-tokens", "10"]
    capsys.readouterr()
    assert generate_main(["--json", "--temperature", "0", *common]) == 0
    result = json.loads(capsys.readouterr().out.splitlines()[0])
    eos = hf_tokenizer.convert_tokens_to_ids("<|im_end|>")  # (both stop at the folder's eos)
    assert result["token_ids"] == (out[: out.index(eos)] if eos in out else out)
    assert result["text"] == hf_tokenizer.decode(result["token_ids"])
    assert generate_main([*common, "--pipeline-parallel-size", "2"]) == 2
    said = capsys.readouterr().err.strip()
    assert said.endswith("run the folder in one process (rose-generate --hf-model)")


def test_structured_outputs_with_a_folders_own_tokenizer_are_refused_by_name(tmp_path) -> None:
    from roseinfer.request.sampling_params import InvalidParam, StructuredOutputs
    from roseinfer.request.structured import compile_grammar
    from rosetrainer.tokenizer import HFTokenizer

    llama_folder_with_tokenizer(tmp_path)
    with pytest.raises(InvalidParam, match="structured outputs need a tiktoken tokenizer"):
        compile_grammar(StructuredOutputs(regex="[0-9]+"), HFTokenizer(tmp_path))
