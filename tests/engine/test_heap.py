from pagedllm.engine.heap import HeapTrimmer


def test_trims_at_most_once_per_interval(monkeypatch):
    calls = []
    now = [1000.0]
    monkeypatch.setattr("pagedllm.engine.heap.time.monotonic", lambda: now[0])
    trimmer = HeapTrimmer(interval_s=60.0)
    trimmer._trim = lambda pad: calls.append(pad) or 1
    trimmer.maybe_trim()  # the first: trims
    now[0] += 30.0
    trimmer.maybe_trim()  # 30 s later: too soon
    now[0] += 31.0
    trimmer.maybe_trim()  # 61 s after the first: trims again
    assert calls == [0, 0]


def test_does_nothing_without_a_malloc_trim():
    trimmer = HeapTrimmer()
    trimmer._trim = None
    trimmer.maybe_trim()  # no C library function: a no-op, not an error
