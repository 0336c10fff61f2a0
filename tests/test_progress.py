"""Library progress bars honour tqdm's environment switch as well as the caller's flag."""

from webds.progress import progress_bar


def test_tqdm_disable_env_turns_bars_off(monkeypatch):
    monkeypatch.setenv("TQDM_DISABLE", "1")
    bar = progress_bar(10, "packing", " samples", enabled=True)
    assert bar.disable
    bar.close()


def test_enabled_false_turns_bars_off(monkeypatch):
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    bar = progress_bar(10, "packing", " samples", enabled=False)
    assert bar.disable
    bar.close()
