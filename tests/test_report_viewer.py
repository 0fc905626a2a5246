"""``tracerl report --serve``: the JSON API over real HTTP on a real run's folder, and the page
in a real headless Chromium (Debian's package): curves drawn, a trajectory opened."""

import json
import shutil
import subprocess
import urllib.error
import urllib.request

import pytest

from tracerl.viewer import Viewer


@pytest.fixture(scope="module")
def viewer(unhealthy_step):
    with Viewer(unhealthy_step[3]) as v:
        yield v


def get(viewer, path: str):
    with urllib.request.urlopen(viewer.url.rstrip("/") + path, timeout=30) as r:
        return json.loads(r.read())


def last_train_step(viewer) -> int:
    return get(viewer, "/api/steps")["train"][-1]


def test_history_has_the_step_health_curves(viewer):
    train = [h for h in get(viewer, "/api/history") if h["split"] == "train"]
    assert train[-1]["prefix_mismatch_fraction"] == 1.0 and "engine_kl" in train[-1]


def test_a_step_shows_its_groups_rewards_and_advantages(viewer):
    step = get(viewer, f"/api/step/train/{last_train_step(viewer)}")
    equal, rewriter = step["groups"][0], step["groups"][1]
    assert equal["skipped"] and equal["rewards"] == [0.5, 0.5]
    assert not rewriter["skipped"] and rewriter["advantages"][0] < 0 < rewriter["advantages"][1]


def test_a_trajectory_shows_its_calls_and_tokens(viewer):
    t = get(viewer, f"/api/trajectory/train/{last_train_step(viewer)}/1/1")
    assert len(t["calls"]) == 2 and t["advantage"] > 0
    first = t["calls"][0]
    assert first["messages"][-1]["content"] == "Name a fruit."
    assert first["tokens"] and all(isinstance(tk["logprob"], float) for tk in first["tokens"])
    assert "".join(tk["text"] for tk in first["tokens"]).strip()  # decoded, not ids
    # the training step kept the trainer's logprob of every trained token: same weights, so
    # engine and trainer agree closely
    diffs = [abs(tk["trainer_logprob"] - tk["logprob"]) for call in t["calls"]
             for tk in call["tokens"]]
    assert len(diffs) == sum(len(call["tokens"]) for call in t["calls"]) and max(diffs) < 0.05


def test_doctor_findings_are_served(viewer):
    findings = {f["check"]: f["status"] for f in get(viewer, "/api/doctor")}
    assert findings["prefix_mismatch_fraction"] in ("warn", "fail")


def test_unknown_paths_are_404(viewer):
    with pytest.raises(urllib.error.HTTPError) as e:
        get(viewer, "/api/step/train/9999")
    assert e.value.code == 404


def test_the_page_draws_curves_and_opens_a_trajectory_in_chromium(viewer, tmp_path):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("Debian's chromium is not installed (apt-get install chromium)")
    url = f"{viewer.url}#traj=train/{last_train_step(viewer)}/1/1"
    out = subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
         f"--user-data-dir={tmp_path}", "--virtual-time-budget=10000", "--dump-dom", url],
        capture_output=True, text=True, timeout=120)
    dom = out.stdout
    assert 'class="chart" data-metric="reward"' in dom and "<polyline" in dom, out.stderr[-2000:]
    assert 'id="traj-summary"' in dom and "Name a fruit." in dom
    assert "trainer - engine " in dom and "trainer logprob -" in dom
    assert 'class="finding ' in dom


def test_the_static_report_lists_each_step_health_warning(unhealthy_step):
    from tracerl.report import build_report

    page = build_report(unhealthy_step[3])
    assert "<h2>Step health</h2>" in page and 'aria-label="prefix_mismatch_fraction"' in page
    assert "the agent edits history between calls" in page and "<i>fix:</i>" in page
