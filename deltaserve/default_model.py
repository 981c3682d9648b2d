"""The default model: until a trained model ships, the `k31-tiny` preset written once into the cache folder."""

from pathlib import Path

from . import envs

DEFAULT_PRESET = "k31-tiny"


def default_model_path() -> Path:
    """Folder of the default checkpoint, written on first use (a complete folder has config.json last)."""
    from .tools.make_model import write_checkpoint
    from .tools.presets import get_preset

    path = envs.cache_dir() / "models" / DEFAULT_PRESET
    if not path.is_dir():
        # Write beside the final name, then rename: an interrupted write never looks like a complete model.
        tmp = path.with_name(path.name + ".partial")
        write_checkpoint(get_preset(DEFAULT_PRESET), tmp)
        tmp.rename(path)
    return path
