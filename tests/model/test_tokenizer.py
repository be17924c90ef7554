"""The tokenizer wrapper: long texts do not hold the GIL, too-long prompts are refused
before their ids are built, and incremental detokenization equals a whole decode."""

from __future__ import annotations

import random
import threading
import time

import pytest

from kvserve.default_model import default_model_path
from kvserve.engine.output import IncrementalDetokenizer
from kvserve.model.tokenizer import PromptTooLong, load_tokenizer
from kvserve.testing.procs import wait_until


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(default_model_path())


def test_long_text_leaves_other_threads_running(tok):
    """A 1 MB prompt takes about a second to tokenize; a thread ticking every 5 ms keeps
    ticking meanwhile (the single-text call held the GIL: no tick for the whole time)."""
    text = "x = 1\n" * 170_000
    ticks = []
    done = threading.Event()

    def ticker() -> None:
        while not done.wait(0.005):  # a tick every 5 ms while it can get the GIL
            ticks.append(time.perf_counter())

    t = threading.Thread(target=ticker)
    t.start()
    wait_until(lambda: len(ticks) >= 2, 10, "the ticker runs")
    start = time.perf_counter()
    ids = tok.encode(text)
    end = time.perf_counter()
    done.set()
    t.join(10)
    assert ids == tok._tok.encode(text).ids  # the same ids as the single-text call
    during = [x for x in ticks if start < x < end]
    assert len(during) >= min(5, (end - start) / 0.05), (len(during), end - start)


def test_too_long_is_refused_with_its_count(tok):
    text = "x = 1\n" * 20_000
    n = len(tok.encode(text))
    with pytest.raises(PromptTooLong) as e:
        tok.encode(text, max_tokens=n - 1)
    assert e.value.num_tokens == n
    assert len(tok.encode(text, max_tokens=n)) == n


def test_incremental_detokenization_equals_a_whole_decode(tok):
    """Random ids (invalid UTF-8 sequences included), pushed 1-3 at a time, with and
    without special tokens: the streamed text is the whole decode once flushed."""
    rng = random.Random(0)
    for _ in range(100):
        ids = [rng.randrange(tok.vocab_size) for _ in range(40)]
        for skip in (True, False):
            d = IncrementalDetokenizer(tok, skip)
            text, k = "", 0
            while k < len(ids):
                n = rng.choice([1, 1, 2, 3])
                text += d.push(ids[k : k + n])
                k += n
            text += d.flush()
            assert text == tok.decode(ids, skip)
