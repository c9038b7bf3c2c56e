"""deploy/llama_cpp.py without building: the cache's rule (only a finished, renamed folder counts), the CLI's
output read back, and the settings it refuses (the build and the CLI itself run in tests/integration/test_llama_cpp.py)."""

from __future__ import annotations

import pytest

from deploy import llama_cpp
from difflm.models.evaluation.record import EvalRecord

# the end of a real run's stdout (llama-diffusion-cli of 0.3.36 on a test-tiny LLaDA GGUF, --log-jsonl)
STDOUT = """{"type":"log","time":162581,"level":"info","msg":"\\rdiffusion step: 8/12 [====    ] 66%"}
{"type":"log","time":162993,"level":"info","msg":"\\ntotal time: 1234.50ms, time per step: 102.88ms, sampling time per step: 0.21ms\\n"}
{"type":"log","time":163010,"level":"info","msg":"\\n the dog ran\\n\\nto it\\n"}
"""


def test_only_a_finished_build_is_taken(tmp_path, monkeypatch):
    monkeypatch.setenv("DIFFLM_LLAMA_CPP_CACHE", str(tmp_path))
    assert llama_cpp.version_dir() == tmp_path / llama_cpp.VERSION and llama_cpp.built() is None
    half = tmp_path / f".{llama_cpp.VERSION}-building-x" / llama_cpp.VERSION / "bin"  # a build still running
    half.mkdir(parents=True)
    (half / llama_cpp.BINARY).write_text("")
    assert llama_cpp.built() is None
    (half.parent).rename(llama_cpp.version_dir())  # what build() does once the binary and sources are in place
    assert llama_cpp.built() is None  # not executable
    llama_cpp.binary().chmod(0o755)
    assert llama_cpp.built() == llama_cpp.binary()
    assert llama_cpp.main(["path"]) == 0


def test_the_generated_text_and_the_loop_time_are_read_from_the_output():
    got = llama_cpp.parse_output(STDOUT, "", 12, ["x"])
    assert got.text == " the dog ran\n\nto it" and got.seconds == pytest.approx(1.2345)
    with pytest.raises(RuntimeError, match="no 'total time' line"):
        llama_cpp.parse_output(STDOUT.splitlines()[0], "error: failed to load model\n", 12, ["x"])


def test_settings_llama_cpp_cannot_match_are_refused_before_running():
    with pytest.raises(ValueError, match="exactly one of block_length"):
        llama_cpp.generate("m.gguf", "p", length=32, steps=4, block_length=8, eps=1e-3)
    with pytest.raises(ValueError, match="algorithm must be one of"):
        llama_cpp.generate("m.gguf", "p", length=32, steps=4, block_length=8, algorithm="low_confidence")
    llama_cpp.check_canvas(3, 32, 4, 8)  # 4 blocks of 8 from the prompt's end, a step each
    for prompt, length, steps in ((8, 32, 4), (3, 30, 4), (3, 32, 6)):
        with pytest.raises(ValueError, match="for its blocks to be ours"):
            llama_cpp.check_canvas(prompt, length, steps, 8)


def test_the_matching_sampler_commits_leftmost_argmax_tokens_without_an_eos_stop():
    s = llama_cpp.matching_sampler(12, eps=1e-3)
    assert (s.remasking, s.temperature, s.stop_at_eos, s.eps, s.block_length) == (
        "left_to_right",
        0.0,
        False,
        1e-3,
        None,
    )


def test_our_text_gets_llama_cpps_space_clean_up():
    """What llama_vocab::impl::detokenize does to a gpt-2 vocabulary's text (smollm's is left alone)."""
    text = "it 's , he ' d say . we 're here ! don 't ? they 'll"
    assert llama_cpp.clean_spaces(text) == "it's, he'd say. we're here! don 't? they 'll"
    assert llama_cpp.clean_spaces("") == "" and llama_cpp.clean_spaces(" .") == "."


def test_the_evaluation_record_keeps_a_row_per_engine(tmp_path):
    """benchmarks/engines.py --record: the rows go into results.json's `engines` and read back."""
    record = EvalRecord(mode="difflm-noshift", data_hash="d" * 12, export="x", bounds={"trained": {}})
    rows = [{"engine": "llama.cpp", "version": llama_cpp.VERSION, "tokens_per_s": 1359.0, "settings": {"steps": 12}}]
    record.replace(engines=rows).write(tmp_path)
    assert EvalRecord.read(tmp_path).engines == rows
    assert "engines" not in record.to_dict()  # absent until an engine was measured


def test_a_finished_build_is_moved_into_the_cache_whole(tmp_path, monkeypatch):
    """install_build: the binary, the converter with gguf-py and the log, renamed into <cache>/<version> at once."""
    monkeypatch.setenv("DIFFLM_LLAMA_CPP_CACHE", str(tmp_path / "cache"))
    work, source = tmp_path / "cache" / f".{llama_cpp.VERSION}-building-x", tmp_path / "llama.cpp"
    (work / "build" / "bin").mkdir(parents=True)
    (work / "build" / "bin" / llama_cpp.BINARY).write_text("")
    (work / "build" / "bin" / llama_cpp.BINARY).chmod(0o755)
    (work / "build.log").write_text("built")
    for name in ("conversion", "gguf-py/gguf"):
        (source / name).mkdir(parents=True)
    (source / "convert_hf_to_gguf.py").write_text("")
    llama_cpp.install_build(work, source)
    assert llama_cpp.built() == llama_cpp.binary() and llama_cpp.converter().is_file()
    assert (llama_cpp.version_dir() / "src" / "gguf-py" / "gguf").is_dir() and not (work / llama_cpp.VERSION).exists()
