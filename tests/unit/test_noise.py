"""Library noise is filtered in rlsys's processes, children included, and ``RLSYS_VERBOSE=1`` shows it."""

import subprocess
import sys

import pytest

from rlsys.telemetry import noise

CHILD = (
    "import warnings\n"
    "warnings.warn('Apex is not installed. Falling back to Torch Norm')\n"
    "warnings.warn('Transformer Engine and Apex are not installed. Falling back to Torch optimizers.')\n"
    "warnings.warn('a warning rlsys does not know')\n"
)


def _child_stderr(env: dict) -> str:
    return subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True).stderr


def test_children_filter_known_noise_and_keep_the_rest(monkeypatch):
    monkeypatch.delenv(noise.VERBOSE_ENV, raising=False)
    err = _child_stderr(noise.worker_env())
    assert "not installed" not in err
    assert "a warning rlsys does not know" in err


def test_verbose_shows_everything(monkeypatch):
    monkeypatch.setenv(noise.VERBOSE_ENV, "1")
    env = noise.worker_env()
    assert "PYTHONWARNINGS" not in env
    assert "Apex is not installed" in _child_stderr(env)


def test_in_process_filter(monkeypatch):
    import warnings

    monkeypatch.delenv(noise.VERBOSE_ENV, raising=False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        noise.quiet_libraries()
        warnings.warn("Apex is not installed. Falling back to Torch Norm", stacklevel=1)
        warnings.warn("unknown", UserWarning, stacklevel=1)
    assert [str(w.message) for w in seen] == ["unknown"]


@pytest.mark.parametrize("category, message", noise.KNOWN_NOISE)
def test_filters_survive_pythonwarnings_syntax(category, message):
    assert "," not in message and ":" not in message  # PYTHONWARNINGS separators
