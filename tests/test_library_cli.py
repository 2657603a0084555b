"""The library's command line: help in sentences, every option explained, one error line for a user's mistake."""
import argparse

import pytest

from sparsevid.cli import COMMAND_MODULES, build_parser, main


def subparser(name: str) -> argparse.ArgumentParser:
    actions = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return actions[0].choices[name]


def test_top_level_help_names_the_commands_and_the_cpu_path_as_it_measured():
    text = " ".join(build_parser().format_help().split())
    assert "distill" in text and "evaluate" in text and "python -m sparsevid_lab --help" in text
    assert "slower than dense" not in text and "3.3-5.6x faster than dense attention forward" in text


@pytest.mark.parametrize("name", COMMAND_MODULES)
def test_every_option_has_help(name):
    parser = subparser(name)
    assert parser.description and parser.description.endswith(".")
    for action in parser._actions:
        if not isinstance(action, argparse._HelpAction):
            assert action.help, f"{name} {action.option_strings} has no help"


def test_a_missing_data_folder_is_one_error_line(tmp_path, capsys):
    assert main(["distill", "--model", str(tmp_path), "--data", str(tmp_path / "none"), "--out", str(tmp_path / "o"),
                 "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "latent samples" in err[0]
    with pytest.raises(SystemExit):
        main(["evaluate", "--model", "m", "--data", "d", "--sparse", "rule=nonsense"])
