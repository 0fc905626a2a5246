"""The command line: errors are one clear line and exit code 2."""

from tracerl.cli import main


def test_unknown_base_model_exits_with_code_2(capsys):
    assert main(["prepare-model", "/no/such/model"]) == 2


def test_unknown_base_model_is_one_line_saying_no_hub_is_used(capsys):
    main(["prepare-model", "/no/such/model"])
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("tracerl: error: ")
    assert "neither a model folder" in line and "no model hub is used" in line
