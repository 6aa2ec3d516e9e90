"""The installed callback: its flag is in `mega train --help`, and its listener writes the CSV."""

import subprocess
import sys
from types import SimpleNamespace

from plugin_module import Options

from mega.core.plugins import Events, get_plugins
from mega.train.run_config import RunConfig


def test_mega_train_lists_the_flag_under_the_plugin():
    done = subprocess.run([sys.executable, "-m", "mega.core.cli.main", "train", "--help"],
                          capture_output=True, text=True, check=True)
    assert "plugin plugin_module (plugin_dist)" in done.stdout and "--plugin_flag" in done.stdout


def test_the_listener_writes_each_steps_loss(tmp_path):
    path = tmp_path / "loss.csv"
    factory = get_plugins().callbacks.get("plugin_name")
    assert factory(RunConfig(model=None)) is None  # not asked for: takes no part
    events = Events([factory(RunConfig(model=None, plugins={"plugin_module": Options(str(path))}))])
    run = SimpleNamespace(is_logging_rank=True)
    events.hook.on_train_start(run=run)
    for iteration, loss in ((1, 2.5), (2, 2.25)):
        events.hook.on_step_end(run=run, iteration=iteration, metrics={"loss": loss})
    assert path.read_text() == "iteration,loss\n1,2.5\n2,2.25\n"
