"""llama.cpp's `llama-diffusion-cli`, built from the llama-cpp-python sdist and cached by version, and a runner for it.

    python3 -m deploy.llama_cpp build     # download, check, build (once: cached), print the binary's path
    python3 -m deploy.llama_cpp path      # the cached binary's path (exit 1 when it is not built)

The sdist on PyPI (llama-cpp-python==VERSION) carries the whole llama.cpp source in vendor/llama.cpp, with
examples/diffusion and the GGUF converter; `pip download` fetches it (its sha256 is checked against SHA256), cmake
and a C++ compiler (Debian's cmake and g++, installed here when missing and running as root) build only the
diffusion CLI, statically linked (so the finished folder can be moved into place), into
<cache>/<VERSION>/bin/llama-diffusion-cli; the cache is DIFFLM_LLAMA_CPP_CACHE, default ~/.cache/difflm/llama.cpp (beside
the Docker images' ~/.cache/difflm/docker). The build happens in a temporary folder inside the cache and is renamed
to <VERSION> when complete, under a lock: a half-finished build is never taken for a finished one, and two builds at
once (the test suite's background build and `make llama-cpp`) do the work once.

Measured on this project's 2-core machine (cmake 3.25, g++ 12, 2026-12-07), shared with other sessions at a load
of 17-22: download and unpack 92 s (12 s idle), the one target with -j2 at nice 10 9.5 CPU-minutes (534 s user, 37 s
system), 39 min of wall time (about 4 min on 2 idle cores: 230 s before the switches below, which cut what cmake
configures, not the ~150 objects the CLI needs: ggml, llama with its model graphs, common)."""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

VERSION = "0.3.36"  # llama-cpp-python's version; its vendor/llama.cpp is the engine
SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"  # llama_cpp_python-0.3.36.tar.gz
BINARY = "llama-diffusion-cli"
PACKAGES = ("cmake", "g++")  # Debian's; `make` comes with build-essential's g++ dependency chain or cmake's
# only what the diffusion CLI needs: no HTTP (curl/openssl), tests, tools, server or unified app; static so that
# the binary finds no shared library by its build folder's path (the build folder is renamed when complete)
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_TOOLS=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DBUILD_SHARED_LIBS=OFF",
)
# llama.cpp leaks its logger at exit (its issue 22142: "logs may be lost if not flushed before the program exits"),
# and the CLI prints the generated text as its last log line: seen lost in 2 of 3 runs on the loaded 2-core machine.
# One line before `return 0` waits for the logger's thread to print what is queued (common_log_pause joins it once
# it has printed every entry); nothing else in the engine is changed.
FLUSH_PATCH = (
    "examples/diffusion/diffusion-cli.cpp",
    "    llama_backend_free();\n\n    return 0;\n}",
    "    llama_backend_free();\n\n    common_log_pause(common_log_main());  // difflm: print the queued log first\n"
    "    return 0;\n}",
)
# what is kept of the source beside the binary: the converter (a GGUF from an HF folder whose tokenizer llama.cpp
# knows, docs/engines.md) and its gguf-py
KEPT = ("convert_hf_to_gguf.py", "conversion", "gguf-py")


class LlamaCppUnavailable(RuntimeError):
    """llama.cpp could not be built here (no compiler, no network to the package index, a failed build)."""


def cache_dir() -> Path:
    return Path(os.environ.get("DIFFLM_LLAMA_CPP_CACHE") or Path.home() / ".cache" / "difflm" / "llama.cpp")


def version_dir() -> Path:
    return cache_dir() / VERSION


def binary() -> Path:
    return version_dir() / "bin" / BINARY


def converter() -> Path:
    """llama.cpp's convert_hf_to_gguf.py of this version (run with PYTHONPATH=<its folder>/gguf-py)."""
    return version_dir() / "src" / "convert_hf_to_gguf.py"


def built() -> Path | None:
    return binary() if os.access(binary(), os.X_OK) else None


def missing_programs() -> list[str]:
    return [p for p in ("cmake", "c++", "make") if shutil.which(p) is None]


def unavailable() -> str | None:
    """Why llama.cpp cannot be built here, with what to do (None: it can, or it is built)."""
    if built():
        return None
    missing = missing_programs()
    if missing and not (os.geteuid() == 0 and shutil.which("apt-get")):
        return (
            f"llama.cpp cannot be built: {', '.join(missing)} missing; as root, `make llama-cpp` installs them "
            f"(apt-get install {' '.join(PACKAGES)})"
        )
    return None


def install(echo=print) -> bool:
    """cmake and g++ from Debian, when missing and this process is root with apt-get; True when all are there."""
    if not missing_programs():
        return True
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return False
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive", "DEBCONF_NOWARNINGS": "yes"}
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", *PACKAGES]):
        done = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if done.returncode != 0:
            echo(f"{' '.join(cmd)} failed: {done.stderr.strip()[-500:]}")
            return False
    return not missing_programs()


def _run(cmd: list[str], log, **kw) -> None:
    """A build step at low priority (the suite's tests run beside it), its output into `log`."""
    nice = ["nice", "-n", "10"] if shutil.which("nice") else []
    done = subprocess.run([*nice, *cmd], stdout=log, stderr=subprocess.STDOUT, **kw)
    if done.returncode != 0:
        raise LlamaCppUnavailable(f"{' '.join(cmd[:4])} ... failed (exit {done.returncode}): see {log.name}")


def download(dest: Path, log) -> Path:
    """The sdist from the package index into `dest`, its sha256 checked."""
    _run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-python", "--quiet"]
        + ["--disable-pip-version-check", f"llama-cpp-python=={VERSION}", "-d", str(dest)],
        log,
    )
    found = list(dest.glob(f"llama_cpp_python-{VERSION}.tar.gz"))
    if not found:
        raise LlamaCppUnavailable(f"pip download left no llama_cpp_python-{VERSION}.tar.gz in {dest}")
    digest = hashlib.sha256(found[0].read_bytes()).hexdigest()
    if digest != SHA256:
        raise LlamaCppUnavailable(f"{found[0].name}: sha256 {digest}, expected {SHA256}: not building from it")
    return found[0]


def patch(source: Path) -> None:
    """FLUSH_PATCH into the unpacked source (LlamaCppUnavailable when its place is not found: another version)."""
    name, old, new = FLUSH_PATCH
    text = (source / name).read_text()
    if text.count(old) != 1:
        raise LlamaCppUnavailable(f"{name} of llama-cpp-python {VERSION} does not end as expected: cannot patch")
    (source / name).write_text(text.replace(old, new))


def install_build(work: Path, source: Path) -> None:
    """The binary, the converter and the build's log from a finished build in `work` into <cache>/<VERSION>,
    staged in `work` and renamed into place: atomic, the folder appears complete or not at all."""
    stage = work / VERSION
    (stage / "bin").mkdir(parents=True)
    (stage / "src").mkdir()
    shutil.copy2(work / "build" / "bin" / BINARY, stage / "bin" / BINARY)
    for name in KEPT:
        src = source / name
        (shutil.copytree if src.is_dir() else shutil.copy2)(src, stage / "src" / name)
    shutil.copy2(work / "build.log", stage / "build.log")
    os.rename(stage, version_dir())


def build(jobs: int = 2, echo=print) -> Path:
    """The cached binary, built first when missing (LlamaCppUnavailable says why it could not be)."""
    if built():
        return binary()
    if not install(echo):
        raise LlamaCppUnavailable(unavailable() or f"apt-get install {' '.join(PACKAGES)} failed")
    cache_dir().mkdir(parents=True, exist_ok=True)
    with open(cache_dir() / f"{VERSION}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second build waits here, then finds the first one's binary
        if built():
            return binary()
        for stale in cache_dir().glob(f".{VERSION}-building-*"):  # a build of ours that was killed (we hold the lock)
            shutil.rmtree(stale, ignore_errors=True)
        t = time.monotonic()
        work = Path(tempfile.mkdtemp(prefix=f".{VERSION}-building-", dir=cache_dir()))
        try:
            with open(work / "build.log", "w") as log:
                sdist = download(work / "sdist", log)
                with tarfile.open(sdist) as tar:
                    tar.extractall(work / "sdist", filter="data")  # no links out of it, no absolute paths
                source = work / "sdist" / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"
                patch(source)
                echo(f"llama.cpp {VERSION}: downloaded and unpacked in {time.monotonic() - t:.0f} s; building {BINARY}")
                _run(["cmake", "-S", str(source), "-B", str(work / "build"), *CMAKE_FLAGS], log)
                _run(["cmake", "--build", str(work / "build"), "--target", BINARY, "-j", str(jobs)], log)
            install_build(work, source)
        except BaseException:
            echo(f"llama.cpp build failed; its log: {work / 'build.log'}")
            raise
        else:
            shutil.rmtree(work)  # the temporary folder this build made
        echo(f"llama.cpp {VERSION}: {binary()} built in {time.monotonic() - t:.0f} s")
    return binary()


# ----- running it ------------------------------------------------------------------------------------------------
ALGORITHMS = {"origin": 0, "entropy": 1, "margin": 2, "random": 3, "confidence": 4}  # --diffusion-algorithm


@dataclass(frozen=True)
class Generation:
    text: str  # the generated positions, detokenized by llama.cpp (special tokens left out)
    seconds: float  # the diffusion loop's own time ("total time"), without loading the model
    steps: int
    argv: list[str]


def generate(
    gguf: Path,
    prompt: str,
    *,
    length: int,
    steps: int,
    block_length: int | None = None,
    eps: float | None = None,
    algorithm: str = "confidence",
    threads: int = 2,
    seed: int = 0,
    exe: Path | None = None,
    timeout: float = 600,
) -> Generation:
    """`llama-diffusion-cli` on `gguf` after `prompt` (llama.cpp tokenizes it, adding BOS when the GGUF says so):
    the canvas is the prompt plus masks up to `length` positions in all (-ub: prompt and generation together).
    Greedy: --temp 0 alone is not (the default top-k 40 / top-p 0.95 chain then draws from the seed), --top-k 1 is
    the argmax; its confidences are then all 1, so every algorithm but origin and random commits the leftmost masked
    positions (our MaskedSampler's remasking="left_to_right"). `block_length`: LLaDA's block schedule (steps split
    over length // block_length blocks counted from the prompt's end); `eps`: Dream's timestep schedule (one block).
    Every value goes in an argument list, never through a shell."""
    if (block_length is None) == (eps is None):
        raise ValueError("llama-diffusion-cli takes exactly one of block_length (LLaDA) and eps (Dream)")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {sorted(ALGORITHMS)}, got {algorithm!r}")
    argv = [str(exe or binary()), "-m", str(Path(gguf)), "-p", prompt, "--temp", "0", "--top-k", "1"]
    argv += ["-ub", str(int(length)), "-b", str(int(length)), "-c", str(int(length)), "-n", str(int(length))]
    argv += ["--diffusion-steps", str(int(steps)), "--diffusion-algorithm", str(ALGORITHMS[algorithm])]
    argv += ["--diffusion-block-length", str(int(block_length))] if block_length else ["--diffusion-eps", str(eps)]
    argv += ["-t", str(int(threads)), "-s", str(int(seed)), "--log-jsonl"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        raise RuntimeError(f"{BINARY} failed (exit {done.returncode}): {(done.stderr or done.stdout)[-1500:]}")
    return parse_output(done.stdout, done.stderr, steps, argv)


def gguf_metadata(gguf: Path) -> dict:
    """What a GGUF says that decides the tokens llama.cpp generates: architecture, BOS (added before the prompt?),
    mask id, logit shift (absent: the CLI shifts), vocabulary size."""
    from gguf import GGUFReader  # a dependency (pyproject.toml); imported here: the build needs none of it

    fields = GGUFReader(str(gguf)).fields

    def get(key: str, default=None):
        return fields[key].contents() if key in fields else default

    return {
        "architecture": get("general.architecture"),
        "add_bos": bool(get("tokenizer.ggml.add_bos_token", False)),
        "bos_id": get("tokenizer.ggml.bos_token_id"),
        "mask_id": get("tokenizer.ggml.mask_token_id"),
        "shift_logits": bool(get("diffusion.shift_logits", True)),
        "vocab": len(get("tokenizer.ggml.tokens", [])),
        # llama-vocab.cpp: a BPE vocabulary cleans spaces in its detokenized text unless its pre-tokenizer says
        # not to; of the two our GGUF writer names (models/hf/gguf_file.py), gpt-2 cleans and smollm does not
        "clean_spaces": get("tokenizer.ggml.model") == "gpt2" and get("tokenizer.ggml.pre") != "smollm",
    }


def clean_spaces(text: str) -> str:
    """llama.cpp's clean-up of detokenized text (llama_vocab::impl::detokenize with clean_spaces, three passes over
    the bytes in place, translated literally): no space before ?!., , " ' " to "'", no space before 's 'm 're 've.
    Our ids decoded by our tokenizer then compare with the CLI's text (which it cleaned)."""
    t = bytearray(text.encode())

    def one_pass(step) -> None:
        total, i, n = (1 if len(t) else 0), 1, len(t)
        while i < n:
            total, i = step(total, i, n)
            i += 1
        del t[total:]

    def punctuation(total: int, i: int, n: int):
        x = t[i]
        if t[i - 1] == 0x20 and x in b"?!.,":
            total -= 1
        t[total] = x
        return total + 1, i

    def apostrophe(total: int, i: int, n: int):
        x = t[i]
        if x == 0x27 and i + 1 < n and t[i - 1] == 0x20 and t[i + 1] == 0x20:
            total -= 1
            i += 1
            t[i] = 0
        t[total] = x
        return total + 1, i

    def contraction(total: int, i: int, n: int):
        x = t[i]
        if t[i - 1] == 0x20 and x == 0x27 and i + 1 < n:
            x1 = t[i + 1]
            if x1 in b"sm" or (i + 2 < n and bytes(t[i + 1 : i + 3]) in (b"re", b"ve")):
                total -= 1
        t[total] = x
        return total + 1, i

    for step in (punctuation, apostrophe, contraction):
        one_pass(step)
    return t.decode(errors="replace")


def prompt_ids(meta: dict, ids: list[int]) -> list[int]:
    """The prompt as llama.cpp feeds it: the tokenizer's ids (no special tokens), after BOS when the GGUF adds it."""
    return ([meta["bos_id"]] if meta["add_bos"] and meta["bos_id"] is not None else []) + list(ids)


def our_text(tokenizer, meta: dict, ids: list[int]) -> str:
    """Our generated ids as the CLI prints its own: decoded without special tokens, then its space clean-up."""
    text = tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    return clean_spaces(text) if meta["clean_spaces"] else text


def matching_sampler(steps: int, block_length: int | None = None, eps: float | None = None):
    """Our MaskedSampler that gives llama-diffusion-cli's tokens (`generate`: --temp 0 --top-k 1, any confidence
    algorithm): argmax tokens committed leftmost first, LLaDA's blocks or Dream's eps schedule, no EOS stop (the
    CLI fills its whole canvas)."""
    from difflm.models.diffusion import MaskedSampler

    return MaskedSampler(
        steps=steps,
        block_length=block_length,
        eps=eps,
        remasking="left_to_right",
        temperature=0.0,
        stop_at_eos=False,
    )


def check_canvas(prompt: int, length: int, steps: int, block_length: int | None) -> None:
    """llama.cpp's blocks start at the prompt's end and number length // block_length (the canvas `length` counts
    the prompt): ours, ceil((length - prompt) / block_length), are the same blocks when the prompt is shorter than
    a block; its steps are split evenly over them."""
    if block_length is None:
        return
    blocks = length // block_length
    if length % block_length or steps % blocks or not 0 < prompt < block_length:
        raise ValueError(
            f"llama-diffusion-cli's blocks: the canvas ({length}) must be a multiple of the block length "
            f"({block_length}), the steps ({steps}) of the {blocks} blocks, and the prompt ({prompt} tokens) shorter "
            "than a block, for its blocks to be ours"
        )


_TOTAL = re.compile(r"^\ntotal time: ([0-9.]+)ms, time per step: [0-9.]+ms, sampling time per step: [0-9.]+ms\n$")


def parse_output(stdout: str, stderr: str, steps: int, argv: list[str]) -> Generation:
    """The generated text and the loop's time from the CLI's log (--log-jsonl: one JSON object a line on stdout,
    so neither the log's own prefixes nor a text's newlines are mistaken for each other): the message after the
    "total time" line is "\n<text>\n"."""
    messages = []
    for line in stdout.splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue  # something printed outside the log
        if isinstance(entry, dict) and entry.get("type") == "log" and isinstance(entry.get("msg"), str):
            messages.append(entry["msg"])
    for k, msg in enumerate(messages[:-1]):
        found = _TOTAL.match(msg)
        if found:
            text = messages[k + 1]
            text = text[1:] if text.startswith("\n") else text
            text = text[:-1] if text.endswith("\n") else text
            return Generation(text, float(found.group(1)) / 1000, steps, argv)
    raise RuntimeError(f"{BINARY} printed no 'total time' line and text: {(stderr or stdout)[-1500:]}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m deploy.llama_cpp", description=__doc__.split("\n\n")[0])
    p.add_argument("action", choices=["build", "path"])
    p.add_argument("-j", "--jobs", type=int, default=2, help="build: parallel compile jobs")
    a = p.parse_args(argv)
    if a.action == "path":
        if not built():
            print(f"llama.cpp {VERSION} is not built: python3 -m deploy.llama_cpp build (or make llama-cpp)")
            return 1
        print(binary())
        return 0
    try:
        exe = build(a.jobs, echo=lambda line: print(line, file=sys.stderr))
    except (LlamaCppUnavailable, OSError) as err:
        print(f"llama.cpp not built: {err}", file=sys.stderr)
        return 1
    print(exe)
    return 0


if __name__ == "__main__":
    sys.exit(main())
