"""The command line as a newcomer meets it: help in sentences, every option explained with its default,
and one `error: ...` line with exit status 2 for a user's mistake (tracebacks only for real bugs)."""
from __future__ import annotations

import argparse

import pytest
import torch

from sparsevid_lab.cli import build_parser, main
from sparsevid.cli.args import topk_arg

COMMANDS = ("demo", "train", "eval", "distill", "compare")


def subparser(name: str) -> argparse.ArgumentParser:
    actions = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return actions[0].choices[name]


def test_top_level_help_says_what_each_command_does():
    text = build_parser().format_help()
    assert "block-sparse attention" in text and "COMMAND --help" in text
    listed = {a.dest: a.help for a in build_parser()._subparsers._group_actions[0]._choices_actions}
    for name in COMMANDS:
        assert listed[name][0].isupper() and listed[name].endswith("."), (name, listed[name])


@pytest.mark.parametrize("name", COMMANDS)
def test_every_option_has_help_and_shows_its_default(name):
    parser = subparser(name)
    assert parser.description and parser.description.endswith(".")
    text = parser.format_help()
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help, f"{name} {action.option_strings} has no help"
        if action.default is not None and not action.required:
            assert f"(default: {action.default}" in " ".join(text.split()), (name, action.option_strings)


def test_topk_reads_whole_numbers_as_counts_and_others_as_fractions():
    assert topk_arg("2") == 2 and isinstance(topk_arg("2"), int)
    assert topk_arg("0.05") == 0.05 and isinstance(topk_arg("0.05"), float)
    assert subparser("demo").parse_args(["--topk", "2"]).topk == 2
    for bad in ("0", "2.5", "-0.1", "many"):
        with pytest.raises(argparse.ArgumentTypeError):
            topk_arg(bad)


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


@pytest.mark.parametrize("argv,message", [
    (["demo", "--topk", "2.5"], "--topk"),
    (["demo", "--topp", "1.5"], "--topp"),
    (["demo", "--model", "no/such/dir"], "builtin.safetensors"),
    (["distill", "--out", "x", "--config", "rule=nope"], "rule must be one of"),
    (["compare", "--tiny", "--student", "no-label"], "LABEL=DIR"),
    (["train", "--out", "x", "--batch-size", "0"], "--batch-size"),
    (["train", "--out", "x", "--clip", "4,32"], "three comma-separated whole numbers"),
    (["eval", "--clip", "4,32,0"], "--clip"),
])
def test_bad_arguments_give_one_error_line_and_status_2(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in one_error_line(capsys)


@pytest.mark.parametrize("argv,message", [
    (["train", "--out", "{tmp}", "--tiny"], "--max-steps"),
    (["distill", "--out", "{tmp}", "--tiny", "--max-steps", "1", "--data", "dir"], "--data-dir"),
    (["distill", "--out", "{tmp}", "--tiny", "--max-steps", "1", "--data", "dir", "--data-dir", "{tmp}/none"],
     "does not exist"),
    (["compare", "--tiny"], "--student or --training-free"),
    (["demo", "--tiny", "--clip", "4,30,32"], "height must be a positive multiple of the patch size"),
])
def test_user_errors_found_later_give_one_error_line_and_status_2(capsys, tmp_path, argv, message):
    assert main([a.format(tmp=tmp_path) for a in argv]) == 2
    assert message in one_error_line(capsys)


def test_unknown_caption_words_are_listed_before_the_model_loads(capsys, monkeypatch):
    def no_loading(args):
        raise AssertionError("the model was loaded before the caption was checked")

    monkeypatch.setattr("sparsevid_lab.cli.demo.load_model", no_loading)
    assert main(["demo", "--tiny", "--caption", "big purple plain circle moving left on a black background"]) == 2
    line = one_error_line(capsys)
    assert "purple" in line and "colours: red, green" in line and "backgrounds: black" in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_is_a_clear_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--device", "cuda"])
    assert exit_info.value.code == 2
    assert "CUDA is not available" in one_error_line(capsys)


def test_real_bugs_keep_their_traceback(monkeypatch):
    def broken(args):
        raise RuntimeError("a bug")

    monkeypatch.setattr("sparsevid_lab.cli.demo.load_model", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        main(["demo", "--tiny"])


def test_an_explicit_steps_wins_over_the_cpu_default(capsys):
    from sparsevid_lab.cli.demo import load_model

    args = argparse.Namespace(model=None, tiny=False, device="cpu", clip=None, steps=10)
    model = load_model(args)
    assert model.config["sampling"]["steps"] == 10 and model.clip_shape == (3, 16, 64, 64)
    said = capsys.readouterr().out
    assert "clip 16x64x64" in said and "steps" not in said.split("(its own")[0]
    model = load_model(argparse.Namespace(**{**vars(args), "steps": None}))
    assert model.config["sampling"]["steps"] == 6 and "steps 6" in capsys.readouterr().out
