"""The default model: a small K3.1-architecture model trained on the Python standard library, shipped inside the
package (deltaserve/data/default_model/, preset `k31-stdlib`, trained by `deltaserve.tools.train`)."""

from pathlib import Path

DEFAULT_PRESET = "k31-stdlib"
DEFAULT_MODEL_DIR = Path(__file__).resolve().parent / "data" / "default_model"


def default_model_path() -> Path:
    """Folder of the shipped default checkpoint (config.json, model.safetensors, tokenizer files)."""
    if not (DEFAULT_MODEL_DIR / "config.json").is_file():
        raise FileNotFoundError(f"the shipped default model is missing from {DEFAULT_MODEL_DIR}; "
                                "reinstall deltaserve or pass a model folder")
    return DEFAULT_MODEL_DIR
