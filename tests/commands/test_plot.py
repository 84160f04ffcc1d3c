"""`hf-scale plot`: what it reads, what it draws, and one-line errors that leave no file behind."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import matplotlib.image
import pytest

from hf_scale.commands.cli import main
from hf_scale.commands.plot import load_plot_data
from hf_scale.train.loops.metrics import StepMetrics

LOSSES = [5.5, 5.1, 4.8, 4.6, 4.5]
TOKENS = [1000, 1200, 800, 1000, 900]


def _metrics_file(run_dir: Path, losses=LOSSES, tokens=TOKENS) -> Path:
    """A metrics.jsonl written by train.py's own StepMetrics (the real format, no training needed)."""
    metrics = StepMetrics(
        str(run_dir), is_main=True, total_steps=len(losses), world_size=1, flops_per_token=None, progress_bar=False
    )
    for step, (loss, count) in enumerate(zip(losses, tokens, strict=True), start=1):
        metrics.log_step(step=step, loss=loss, lr=1e-4, grad_norm=1.0, tokens=count, epoch=step / len(losses))
    metrics.close()
    return run_dir / "metrics.jsonl"


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def hf_scale(capsys, monkeypatch):
    """The real `hf-scale plot` entry point, in this process (a subprocess per case would mostly time imports)."""

    def run(*args: str, cwd: Path) -> Result:
        monkeypatch.chdir(cwd)
        try:
            code = main(["plot", *args])
        except SystemExit as exit_:
            code = exit_.code
        out, err = capsys.readouterr()
        return Result(code, out, err)

    return run


def _png_shape(path: Path) -> tuple[int, ...]:
    return matplotlib.image.imread(path).shape


def test_loss_curve_of_one_run_is_written_as_png(tmp_path, hf_scale):
    metrics = _metrics_file(tmp_path / "run-a")
    result = hf_scale(str(metrics), "-o", "loss.png", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "wrote loss.png"
    height, width, _ = _png_shape(tmp_path / "loss.png")
    assert (width, height) == (770, 495)  # 7 x 4.5 inches at 110 dpi


def test_plotted_values_are_the_recorded_steps_and_losses(tmp_path):
    data = load_plot_data([_metrics_file(tmp_path / "zero3")])
    (run,) = data.runs
    assert run.label == "zero3"  # the run's directory, since every run writes metrics.jsonl
    assert run.steps == [1, 2, 3, 4, 5]
    assert run.losses == LOSSES


def test_throughput_of_a_run_leaves_out_the_first_step(tmp_path):
    metrics = _metrics_file(tmp_path / "run")
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    (run,) = load_plot_data([metrics]).runs
    rates = sorted(r["tokens_per_sec"] for r in records[1:])
    assert run.tokens_per_sec == pytest.approx((rates[1] + rates[2]) / 2)


def test_several_runs_get_their_labels_and_a_two_panel_figure(tmp_path, hf_scale):
    a = _metrics_file(tmp_path / "a")
    b = _metrics_file(tmp_path / "b", losses=[6.0, 5.0, 4.0, 3.0, 2.0])
    data = load_plot_data([a, b], ["DDP", "ZeRO-3"])
    assert [r.label for r in data.runs] == ["DDP", "ZeRO-3"]
    assert data.runs[1].losses == [6.0, 5.0, 4.0, 3.0, 2.0]
    result = hf_scale(str(a), str(b), "--labels", "DDP", "ZeRO-3", "-o", "cmp.svg", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    svg = (tmp_path / "cmp.svg").read_text()
    assert "DDP" in svg and "ZeRO-3" in svg and "throughput" in svg


def test_strategies_results_json_gives_tokens_per_second_per_strategy(tmp_path, hf_scale):
    results = {
        "benchmark": "strategies_cpu",
        "results": {"ddp": {"tokens_per_s": 2000.0}, "zero3": {"tokens_per_s": 1500.0}},
    }
    path = tmp_path / "strategies_cpu.json"
    path.write_text(json.dumps(results))
    assert load_plot_data([path]).strategies == {"ddp": 2000.0, "zero3": 1500.0}
    result = hf_scale(str(path), "-o", "strategies.svg", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "0.75x DDP" in (tmp_path / "strategies.svg").read_text()


@pytest.mark.parametrize(
    ("content", "args", "message"),
    [
        (None, ["missing.jsonl"], "missing.jsonl: not found"),
        ('{"step": 1, "loss": 2.0}\nnot json\n', ["bad.jsonl"], "bad.jsonl:2: not a JSON object"),
        ('{"step": 1}\n', ["bad.jsonl"], "bad.jsonl:1: a metrics record needs 'step' and 'loss'"),
        ("\n", ["bad.jsonl"], "bad.jsonl: no metrics records"),
        ('{"results": {"ddp": {}}}', ["bad.json"], "bad.json: expected a benchmark results file"),
        ('{"step": 1, "loss": 2.0}\n', ["bad.jsonl", "--labels", "a", "b"], "--labels: 2 label(s) for 1 metrics"),
        ('{"step": 1, "loss": 2.0}\n', ["bad.jsonl", "-o", "plot.xyz"], "unsupported image type 'xyz'; allowed:"),
    ],
    ids=["missing", "not-json", "no-loss", "empty", "results-without-rates", "label-count", "image-type"],
)
def test_bad_input_is_one_line_exit_2_and_no_file(tmp_path, hf_scale, content, args, message):
    if content is not None:
        (tmp_path / args[0]).write_text(content)
    if "-o" not in args:
        args = [*args, "-o", "plot.png"]
    result = hf_scale(*args, cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("hf-scale: error: "), result.stderr
    assert message in result.stderr
    assert not list(tmp_path.glob("plot.*"))
