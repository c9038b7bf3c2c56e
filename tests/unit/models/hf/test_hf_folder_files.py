"""An HF folder is read only inside itself: a weight, config or tokenizer file that is a symlink to a file
elsewhere, or a shard index naming an absolute or `../` path, is refused before anything is read or written;
the hub cache's own layout (snapshot files linking to the repository's blobs) still imports."""

import json
import shutil
from pathlib import Path

import pytest
from conftest import tiny_config
from hf_stock import tiny_stock

from difflm.models.hf.convert import ConversionError, import_hf
from difflm.models.hf.importer import check_source, import_pretrained, source_overrides, weight_files

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny ops: one thread is faster (tests/conftest.py)


def _link_out(src: Path, name: str, elsewhere: Path) -> None:
    """Move `name` out of the folder and leave a symlink to it."""
    elsewhere.mkdir(exist_ok=True)
    shutil.move(src / name, elsewhere / name)
    (src / name).symlink_to(elsewhere / name)


@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "tokenizer.json"])
def test_a_file_linked_from_elsewhere_is_refused_and_nothing_is_written(tmp_path, name):
    src = tiny_stock("llama-mha-tied", tmp_path / "src")
    cfg = tiny_config(tmp_path, *source_overrides(src), "diffusion.model_running_mode=ar")
    _link_out(src, name, tmp_path / "elsewhere")
    with pytest.raises(ConversionError) as err:
        import_pretrained(cfg, src, tmp_path / "mg")
    msg = str(err.value)
    assert f"{name} resolves outside the folder ({tmp_path / 'elsewhere' / name})" in msg and "cp -L" in msg
    assert len(msg.splitlines()) == 1 and not list(tmp_path.glob("mg*"))


@pytest.mark.parametrize("shard", ["/etc/secret.safetensors", "../elsewhere/model-00001.safetensors"])
def test_a_shard_index_naming_a_file_outside_is_refused(tmp_path, shard):
    src = tiny_stock("llama-mha-tied", tmp_path / "src", max_shard_size="20KB")
    index = src / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    first = next(iter(data["weight_map"]))
    data["weight_map"][first] = shard
    index.write_text(json.dumps(data))
    with pytest.raises(ConversionError, match=f"the weight file name {shard!r} points outside the folder"):
        check_source(src)


def test_a_shard_linked_from_elsewhere_is_refused(tmp_path):
    src = tiny_stock("llama-mha-tied", tmp_path / "src", max_shard_size="20KB")
    shard = sorted(src.glob("model-*.safetensors"))[0].name
    _link_out(src, shard, tmp_path / "elsewhere")
    with pytest.raises(ConversionError, match=f"{shard} resolves outside the folder"):
        weight_files(src)


def test_the_hub_cache_layout_and_links_inside_the_folder_pass(tmp_path):
    """`<repo>/snapshots/<rev>/<file>` -> `../../blobs/<hash>` is how huggingface_hub stores a download."""
    repo = tmp_path / "models--org--tiny"
    snap = tiny_stock("llama-mha-tied", repo / "snapshots" / "abc123")
    (repo / "blobs").mkdir()
    for i, f in enumerate(sorted(p for p in snap.iterdir() if p.is_file())):
        shutil.move(f, repo / "blobs" / f"hash{i}")
        f.symlink_to(Path("../../blobs") / f"hash{i}")
    (snap / "weights.safetensors").symlink_to("model.safetensors")  # inside the folder
    assert check_source(snap)[1]["model_type"] == "llama"
    (repo / "other").mkdir()
    _link_out(snap, "config.json", repo / "other")  # the repository, not its blobs: refused
    with pytest.raises(ConversionError, match="config.json resolves outside the folder"):
        check_source(snap)


def test_a_difflm_export_with_a_linked_weight_file_is_refused(tmp_path):
    src = tmp_path / "export"
    src.mkdir()
    (src / "config.json").write_text("{}")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "model.safetensors").write_bytes(b"")
    (src / "model.safetensors").symlink_to(tmp_path / "elsewhere" / "model.safetensors")
    with pytest.raises(ConversionError, match="model.safetensors resolves outside the folder"):
        import_hf(tiny_config(tmp_path), src, tmp_path / "mg", {"vocab_size": 96})
    assert not (tmp_path / "mg").exists()
