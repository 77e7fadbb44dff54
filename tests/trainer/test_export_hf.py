"""rose-export-hf: a rose checkpoint becomes a folder Hugging Face's Auto classes read, and
they generate rose's tokens, tokenize as rose does, and rose reads the folder back.

The model is the `tiny` preset's shape with a padded vocabulary (50,304 rows, as a
trainer pads it), written by save_checkpoint. Its weights are random with std 0.2 (as
tests/conftest.py's hf_gpt2_dir): GPT's own 0.02 gives near-ties, and a greedy
comparison through near-ties checks little.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from models import assert_clear_margins, assert_varied, write_random_checkpoint
from safetensors.torch import load_file

from rosecourse.demo import wide_random_init
from roseinfer.cli.export_hf import main
from roseinfer.loading import load_model_and_tokenizer
from roseinfer.loops.generate import generate
from roseinfer.request.sampling import SamplingParams
from rosetrainer.checkpoint import load_model, save_checkpoint
from rosetrainer.config import GPTConfig
from rosetrainer.errors import RoseError
from rosetrainer.files import new_directory
from rosetrainer.hf import check_gpt2_config, load_hf, load_hf_gpt2, save_hf
from rosetrainer.model import GPT
from rosetrainer.numerics import logit_tolerance
from rosetrainer.tokenizer import Tokenizer

NEW_TOKENS = 40
# Two implementations of one network (HF's Conv1D and attention, rose's Linear and SDPA)
HF_LOGIT_ATOL = 2e-4
VARIED_TEXT = (
    "ROMEO: But, soft! what light through yonder window breaks?\n\n"
    "  indented\ttab  double  spaces   and trailing   \n"
    "Ünïcödé, 日本語のテキスト, emoji 🌹🤖, Ελληνικά, العربية, 'quotes' \"and\" it's we'll\n"
    "<|endoftext|> a literal end-of-text marker<|endoftext|>twice\r\n\n"
)
FILES = [
    "config.json",
    "generation_config.json",
    "merges.txt",
    "model.safetensors",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def rose_model(tiny_run_dir: Path) -> GPT:
    model, _, _ = load_model_and_tokenizer(str(tiny_run_dir))
    return model


@pytest.mark.slow
def test_the_folder_is_gpt2s(tiny_hf_export: Path) -> None:
    assert sorted(p.name for p in tiny_hf_export.iterdir()) == FILES
    config = json.loads((tiny_hf_export / "config.json").read_text())
    assert config["architectures"] == ["GPT2LMHeadModel"] and config["model_type"] == "gpt2"
    assert config["n_positions"] == config["n_ctx"] == 128
    assert config["vocab_size"] == 50257  # the padding rows are dropped...
    weights = load_file(tiny_hf_export / "model.safetensors")
    assert weights["transformer.wte.weight"].shape == (50257, 128)  # ...from the weights too
    assert "lm_head.weight" not in weights  # tied: transformers ties it on load
    generation = json.loads((tiny_hf_export / "generation_config.json").read_text())
    assert generation["eos_token_id"] == Tokenizer().eot_id


def test_the_tokenizer_files_hold_openais_vocabulary_and_merges(
    tiny_hf_export: Path, tiktoken_cache: str
) -> None:
    """Built from tiktoken's ranks, they equal GPT-2's published encoder.json and vocab.bpe,
    which tiktoken keeps in its cache under the sha1 of their URLs."""

    def original(name: str) -> str:
        url = f"https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/{name}"
        return (Path(tiktoken_cache) / hashlib.sha1(url.encode()).hexdigest()).read_text("utf-8")

    vocab = json.loads((tiny_hf_export / "vocab.json").read_text("utf-8"))
    assert vocab == json.loads(original("encoder.json"))
    assert (tiny_hf_export / "merges.txt").read_text("utf-8") == original("vocab.bpe")


@pytest.mark.slow
def test_transformers_generates_roses_greedy_tokens(tiny_hf_export: Path, rose_model: GPT) -> None:
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(tiny_hf_export).eval()
    assert type(hf_model).__name__ == "GPT2LMHeadModel"
    tokenizer = Tokenizer()
    prompt = tokenizer.encode("ROMEO: But, soft!")
    params = SamplingParams(max_tokens=NEW_TOKENS)
    oracle = generate(
        rose_model, prompt, params, use_cache=False, eot_id=tokenizer.eot_id, keep_logits=True
    )
    assert len(oracle.token_ids) == NEW_TOKENS
    assert_varied(oracle.token_ids)
    assert_clear_margins(oracle.step_logits)
    with torch.no_grad():  # the folder's generation_config.json: end-of-text stops it
        out = hf_model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
            output_logits=True,
            return_dict_in_generate=True,
        )
    assert out.sequences[0, len(prompt) :].tolist() == oracle.token_ids
    for ours, theirs in zip(oracle.step_logits, out.logits, strict=True):
        assert torch.allclose(ours, theirs[0], atol=HF_LOGIT_ATOL, rtol=0)


def test_the_model_as_trained_with_its_padding_scores_as_its_export(
    tiny_run_dir: Path, tiny_hf_export: Path
) -> None:
    """The checkpoint's own model, its 47 padding rows in place, returns the logits of the
    vocabulary's ids, as the export (the rows dropped) does."""
    trained, _ = load_model(tiny_run_dir / "last.pt")
    assert trained.lm_head.weight.shape[0] == 50304 and trained.config.vocab_size == 50257
    exported = load_hf_gpt2(str(tiny_hf_export)).eval()
    ids = torch.tensor([Tokenizer().encode(VARIED_TEXT)[:128]])
    with torch.no_grad():
        want, got = exported(ids).logits, trained.eval()(ids).logits
    assert got.shape == want.shape == (1, ids.size(1), 50257)
    assert float((got - want).abs().max()) <= logit_tolerance(want)


@pytest.mark.parametrize(
    ("preset", "tied"), [("tiny", True), ("tiny-llama", True), ("tiny-llama", False)]
)
def test_save_hf_drops_the_padding_rows_of_a_model_as_trained(
    preset: str, tied: bool, tmp_path: Path
) -> None:
    """save_hf on the trainer's model itself (no loading between): the folder holds the
    vocabulary's rows, and reads back to the same logits."""
    config = GPTConfig.from_preset(
        preset, n_layer=1, block_size=16, vocab_multiple=64, tie_embeddings=tied
    )
    model = wide_random_init(GPT(config), 0).eval()
    if config.tie_embeddings:
        model.lm_head.weight = model.transformer.wte.weight
    save_hf(model, Tokenizer().encoding, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["vocab_size"] == 50257
    assert {tuple(t.shape) for n, t in load_file(tmp_path / "model.safetensors").items()
            if "embed" in n or "wte" in n or "lm_head" in n} == {(50257, 128)}  # fmt: skip
    ids = torch.tensor([Tokenizer().encode(VARIED_TEXT)[:16]])
    with torch.no_grad():
        want, got = model(ids).logits, load_hf(str(tmp_path)).eval()(ids).logits
    assert float((got - want).abs().max()) <= logit_tolerance(want)


@pytest.mark.slow
def test_autotokenizer_encodes_and_decodes_as_rose(tiny_hf_export: Path) -> None:
    from transformers import AutoTokenizer

    hf_tokenizer = AutoTokenizer.from_pretrained(tiny_hf_export)
    tokenizer = Tokenizer()
    ids = tokenizer.encode(VARIED_TEXT)
    assert hf_tokenizer(VARIED_TEXT)["input_ids"] == ids
    assert hf_tokenizer.decode(ids) == VARIED_TEXT
    assert hf_tokenizer.eos_token_id == tokenizer.eot_id
    assert hf_tokenizer.decode([tokenizer.eot_id]) == "<|endoftext|>"


def test_rose_reads_the_folder_back_to_identical_logits(
    tiny_hf_export: Path, rose_model: GPT
) -> None:
    again = load_hf_gpt2(str(tiny_hf_export)).eval()
    ids = torch.tensor([Tokenizer().encode(VARIED_TEXT)[:128]])
    with torch.no_grad():
        assert torch.equal(again(ids).logits, rose_model(ids).logits)


def check_refused(args: list[str], capsys: pytest.CaptureFixture[str], says: str) -> None:
    assert main(args) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("[roseinfer.cli.export_hf] error:"), lines
    assert says in lines[0]


def test_no_checkpoint_writes_nothing(tmp_path: Path, capsys) -> None:
    out = tmp_path / "out" / "hf"
    check_refused(
        ["--checkpoint-path", str(tmp_path / "none.pt"), "--out", str(out)], capsys, "not found"
    )
    assert not out.exists() and list((tmp_path / "out").iterdir()) == []


@pytest.mark.slow
def test_a_non_empty_folder_needs_overwrite(tiny_run_dir: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "hf"
    out.mkdir()
    (out / "mine.txt").write_text("keep me")
    check_refused(
        ["--checkpoint-path", str(tiny_run_dir), "--out", str(out)], capsys, "--overwrite"
    )
    assert [p.name for p in out.iterdir()] == ["mine.txt"]
    assert main(["--checkpoint-path", str(tiny_run_dir), "--out", str(out), "--overwrite"]) == 0
    assert sorted(p.name for p in out.iterdir()) == FILES
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]  # no temporary folder left


def test_a_failed_overwrite_leaves_the_old_folder_as_it_was(tmp_path: Path) -> None:
    out = tmp_path / "hf"
    out.mkdir()
    (out / "config.json").write_text("old")
    with pytest.raises(RuntimeError, match="crash"), new_directory(out, overwrite=True) as new:
        (new / "config.json").write_text("half of the new one")
        raise RuntimeError("crash mid-export")
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]  # the temporary folder is gone
    assert (out / "config.json").read_text() == "old"


def test_an_unwritable_path_is_refused(tiny_run_dir: Path, tmp_path: Path, capsys) -> None:
    (tmp_path / "a_file").write_text("")
    out = tmp_path / "a_file" / "hf"
    check_refused(
        ["--checkpoint-path", str(tiny_run_dir), "--out", str(out)], capsys, "cannot write"
    )


def test_a_model_gpt2_cannot_express_is_refused_whole(tmp_path: Path, capsys) -> None:
    run = tmp_path / "run"
    write_random_checkpoint(run / "last.pt", GPTConfig(n_layer=1, n_head=2, n_embd=16, bias=False))
    out = tmp_path / "hf"
    check_refused(["--checkpoint-path", str(run), "--out", str(out)], capsys, "bias=False")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # nothing half-written


def test_an_untied_output_matrix_is_refused_whole(tmp_path: Path, capsys) -> None:
    config = GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=16)
    model = wide_random_init(GPT(config), 0)  # an output matrix of its own
    state = {"model": model.state_dict(), "model_config": config.to_dict()}
    save_checkpoint(tmp_path / "run" / "last.pt", state)
    args = ["--checkpoint-path", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]
    check_refused(args, capsys, "output matrix lm_head differs from its token embedding")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_any_non_default_config_field_is_refused() -> None:
    # A field the export does not know (a rotary model's, say) at a value other than its
    # default has no GPT-2 equivalent; at its default it computes GPT-2.
    fields = [("position_embedding", str, dataclasses.field(default="learned"))]
    Extended = dataclasses.make_dataclass("Extended", fields, bases=(GPTConfig,))
    check_gpt2_config(Extended(position_embedding="learned"))
    with pytest.raises(RoseError, match="position_embedding='rotary'"):
        check_gpt2_config(Extended(position_embedding="rotary"))


# -- issue 33: the export never deletes what it reads; Ctrl-C and a full disk in one line --


@pytest.mark.parametrize("where", ["the run", "a link to the run", "above the run", "in the run"])
def test_an_out_that_is_holds_or_is_inside_the_source_is_refused(
    tiny_run_dir: Path, tmp_path: Path, capsys, where: str
) -> None:
    run = tmp_path / "parent" / "run"
    run.mkdir(parents=True)
    (run / "last.pt").write_bytes((tiny_run_dir / "last.pt").read_bytes())
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    (tmp_path / "link").symlink_to(run)
    out = {"the run": run, "a link to the run": tmp_path / "link",
           "above the run": run.parent, "in the run": run / "hf"}[where]  # fmt: skip
    before = {p: p.read_bytes() for p in run.rglob("*")}
    says = "inside" if where == "in the run" else "which it is made from"
    check_refused(["--checkpoint-path", str(run), "--out", str(out), "--overwrite"], capsys, says)
    assert {p: p.read_bytes() for p in run.rglob("*")} == before  # nothing deleted or added
    # A checkpoint file as the source: the folder holding it is refused too.
    check_refused(
        ["--checkpoint-path", str(run / "last.pt"), "--out", str(run), "--overwrite"],
        capsys,
        "holds",
    )
    assert {p: p.read_bytes() for p in run.rglob("*")} == before


def test_an_out_that_holds_a_linked_checkpoint_is_refused(
    tiny_run_dir: Path, tmp_path: Path, capsys
) -> None:
    """RUN/best.pt a link to another run's checkpoint: --out RUN --overwrite would replace
    RUN, the link and everything beside it (notes.txt), though the link's target is
    elsewhere. The folder holding the checkpoint as named is refused too."""
    other = tmp_path / "other"
    other.mkdir()
    (other / "last.pt").write_bytes((tiny_run_dir / "last.pt").read_bytes())
    run = tmp_path / "run"
    run.mkdir()
    (run / "best.pt").symlink_to(other / "last.pt")
    (run / "notes.txt").write_text("mine\n")
    args = ["--checkpoint-path", str(run / "best.pt"), "--out", str(run), "--overwrite"]
    check_refused(args, capsys, "holds")
    assert (run / "notes.txt").read_text() == "mine\n" and (run / "best.pt").is_symlink()


@pytest.mark.slow
def test_an_out_that_is_a_link_fills_the_folder_it_leads_to(
    tiny_run_dir: Path, tmp_path: Path
) -> None:
    """--out LINK --overwrite replaces what LINK leads to; the link stays a link, and no
    moved-aside folder is left beside it (it was, renamed to .LINK.<pid>.old.tmp)."""
    target = tmp_path / "hf-target"
    target.mkdir()
    (target / "old.txt").write_text("old export\n")
    link = tmp_path / "hf"
    link.symlink_to(target)
    args = ["--checkpoint-path", str(tiny_run_dir), "--out", str(link), "--overwrite"]
    assert main(args) == 0
    assert link.is_symlink() and link.resolve() == target.resolve()
    assert (target / "config.json").is_file() and not (target / "old.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "hf-target"]


def test_ctrl_c_is_one_line_exit_130_and_leaves_nothing(
    tiny_run_dir: Path, tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    def interrupted(*args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr("roseinfer.cli.export_hf.save_hf", interrupted)
    assert main(["--checkpoint-path", str(tiny_run_dir), "--out", str(tmp_path / "hf")]) == 130
    err = capsys.readouterr().err
    assert err == "[roseinfer.cli.export_hf] interrupted: stopped by Ctrl-C\n"
    assert list(tmp_path.iterdir()) == []  # no folder, no temporary one


@pytest.mark.slow
def test_a_full_disk_while_safetensors_writes_is_one_line(
    tiny_run_dir: Path, tmp_path: Path
) -> None:
    """safetensors writes the weights itself and fails with its own SafetensorError (not
    an OSError): the process may write files of 8 MB at most, room for the tokenizer's
    files but not for the weights, so the failure is the one the real library raises."""

    def small_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (8 << 20, 8 << 20))

    out = tmp_path / "hf"
    command = [sys.executable, "-m", "roseinfer.cli.export_hf", "--checkpoint-path",
               str(tiny_run_dir), "--out", str(out)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, preexec_fn=small_files)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        f"[roseinfer.cli.export_hf] error: cannot write {out}: the file is larger than this "
        "process may write (ulimit -f); free space, fix the permissions or choose another path"
    ]
    assert list(tmp_path.iterdir()) == []
