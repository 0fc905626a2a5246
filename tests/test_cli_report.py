"""`tracerl report` on a model folder written by the real storage code."""

import re

import tracerl
from tracerl.cli import main
from tracerl.core.storage import ModelStore
from tracerl.core.trajectory import write_groups_jsonl
from tracerl.report import COLOURS


def make_model_dir(tmp_path):
    store = ModelStore(tmp_path, "p", "m")
    for step, (reward, loss) in enumerate([(0.2, 0.5), (0.4, 0.3), (0.9, 0.1)], start=1):
        store.log_history(step, "train", {"reward": reward, "loss": loss})
    store.log_history(3, "val", {"reward": 0.8})
    group = tracerl.TrajectoryGroup(
        [
            tracerl.Trajectory(
                messages_and_choices=[{"role": "assistant", "content": f"answer <{r}>"}], reward=r
            )
            for r in (0.1, 0.9, 0.5)
        ]
    )
    write_groups_jsonl(store.trajectories_path("train", 3), [group])
    return store.root


def test_report_has_curves_and_best_worst(tmp_path, capsys):
    root = make_model_dir(tmp_path)
    assert main(["report", str(root)]) == 0
    html = (root / "report.html").read_text()
    assert capsys.readouterr().out.strip() == str(root / "report.html")
    train_points = re.search(r'class="series-train"[^>]*points="([^"]+)"', html).group(1).split()
    assert len(train_points) == 3  # three train steps on the reward chart
    ys = [float(p.split(",")[1]) for p in train_points]
    assert ys[0] > ys[1] > ys[2]  # reward rises: SVG y grows downwards
    assert 'class="series-val"' in html
    best = html.index("best 2")
    worst = html.index("worst 2")
    assert html.index("answer &lt;0.9&gt;", best) < worst  # escaped, and in the best section
    assert html.index("answer &lt;0.1&gt;", worst) > worst


def test_report_of_a_non_model_folder_is_a_clear_error(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert "not a model folder" in capsys.readouterr().err


def test_png_report_draws_both_splits(tmp_path, capsys):
    from matplotlib.image import imread

    root = make_model_dir(tmp_path)
    assert main(["report", str(root), "--png"]) == 0
    png = root / "report.png"
    assert capsys.readouterr().out.split() == [str(root / "report.html"), str(png)]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = imread(png)  # rows x columns x RGBA in [0, 1]
    assert pixels.shape[1] == 1000 and pixels.shape[0] == 350

    def count(hex_colour):
        rgb = [int(hex_colour[i:i + 2], 16) / 255 for i in (1, 3, 5)]
        return int((abs(pixels[..., :3] - rgb).max(axis=-1) < 0.02).sum())

    assert count(COLOURS["train"]) > 200 and count(COLOURS["val"]) > 20  # lines and markers drawn

