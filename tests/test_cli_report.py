"""`tracerl report` on a model folder written by the real storage code."""

import re

import pytest

import tracerl
from tracerl.cli import main
from tracerl.core.storage import ModelStore
from tracerl.core.trajectory import write_groups_jsonl
from tracerl.report import COLOURS

TRAIN = [(0.2, 0.5), (0.4, 0.3), (0.9, 0.1)]  # (reward, loss) of steps 1, 2, 3


def make_model_dir(tmp_path):
    store = ModelStore(tmp_path, "p", "m")
    for step, (reward, loss) in enumerate(TRAIN, start=1):
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


@pytest.fixture(scope="module")
def html(tmp_path_factory):
    root = make_model_dir(tmp_path_factory.mktemp("report"))
    assert main(["report", str(root)]) == 0
    return (root / "report.html").read_text()


def reward_points(html, split):
    """The (x, y) points of ``split`` on the reward chart (the first chart)."""
    found = re.search(rf'class="series-{split}"[^>]*points="([^"]+)"', html)
    assert found, f"no {split} series on the reward chart"
    return [tuple(float(v) for v in p.split(",")) for p in found.group(1).split()]


def answers_in_section(html, title):
    """The answers shown under the heading ``title``, in order (up to the next heading)."""
    section = html.split(f"{title}</h2>", 1)[1].split("<h2>", 1)[0]
    return re.findall(r"answer &lt;([0-9.]+)&gt;", section)


def test_report_prints_the_path_it_wrote(tmp_path, capsys):
    root = make_model_dir(tmp_path)
    assert main(["report", str(root)]) == 0
    assert capsys.readouterr().out.strip() == str(root / "report.html")


def test_the_reward_chart_has_one_point_per_train_step(html):
    xs = [x for x, _ in reward_points(html, "train")]
    assert len(xs) == 3 and xs == sorted(xs)


def test_a_higher_reward_is_drawn_higher_up(html):
    ys = [y for _, y in reward_points(html, "train")]
    assert ys[0] > ys[1] > ys[2]  # rewards 0.2 < 0.4 < 0.9; SVG y grows downwards


def test_the_val_series_is_drawn(html):
    assert len(reward_points(html, "val")) == 1


def test_the_best_section_lists_the_highest_rewards_first(html):
    assert answers_in_section(html, "Step 3: best 2") == ["0.9", "0.5"]


def test_the_worst_section_lists_the_lowest_rewards_first(html):
    assert answers_in_section(html, "Step 3: worst 2") == ["0.1", "0.5"]


def test_trajectory_text_is_html_escaped(html):
    assert "answer <" not in html and "answer &lt;0.9&gt;" in html


def test_report_of_a_non_model_folder_is_a_clear_error(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert "not a model folder" in capsys.readouterr().err


@pytest.fixture(scope="module")
def png_report(tmp_path_factory):
    root = make_model_dir(tmp_path_factory.mktemp("png-report"))
    assert main(["report", str(root), "--png"]) == 0
    return root / "report.png"


def test_png_report_prints_both_paths(tmp_path, capsys):
    root = make_model_dir(tmp_path)
    assert main(["report", str(root), "--png"]) == 0
    assert capsys.readouterr().out.split() == [str(root / "report.html"),
                                               str(root / "report.png")]


def test_png_report_is_a_1000_by_350_png(png_report):
    from matplotlib.image import imread

    assert png_report.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert imread(png_report).shape[:2] == (350, 1000)  # rows x columns


@pytest.mark.parametrize(("split", "at_least"), [("train", 200), ("val", 20)],
                         ids=["train", "val"])
def test_png_report_draws_each_split_in_its_colour(png_report, split, at_least):
    from matplotlib.image import imread

    pixels = imread(png_report)  # rows x columns x RGBA in [0, 1]
    colour = COLOURS[split]
    rgb = [int(colour[i:i + 2], 16) / 255 for i in (1, 3, 5)]
    assert int((abs(pixels[..., :3] - rgb).max(axis=-1) < 0.02).sum()) > at_least
