"""The command line: errors are one clear line and exit code 2."""

from tracerl.cli import main


def test_unknown_base_model_is_a_clear_cli_error(capsys):
    assert main(["prepare-model", "/no/such/model"]) == 2
    err = capsys.readouterr().err
    assert "neither a model folder" in err and "no model hub is used" in err
