"""The one line reader (gptop.tail) behind the event socket, the log files and a followed events.jsonl."""

from gptop.tail import FileTail, LineSplitter, feed_events
from trainer.contract import events as ev


def test_chunks_that_end_mid_line_give_whole_lines():
    s = LineSplitter()
    assert s.feed(b"ab") == []
    assert s.feed(b"c\nde") == [b"abc"]
    assert s.feed(b"f\n\ng\n") == [b"def", b"", b"g"]
    assert s.feed(b"tail") == [] and s.rest() == b"tail" and s.rest() == b""


def test_a_file_is_followed_from_its_offset_as_it_grows(tmp_path):
    p = tmp_path / "log"
    t = FileTail(p)
    assert t.read_lines() == []  # not there yet: no error
    p.write_bytes(b"one\ntw")
    assert t.read_lines() == [b"one"]
    with open(p, "ab") as f:
        f.write(b"o\nthree")
    assert t.read_lines() == [b"two"] and t.read_lines() == []
    assert t.rest() == b"three"
    later = FileTail(p, offset=len(b"one\n"))  # a restart's logs start where the last one ended
    assert later.read_lines() == [b"two"]


def test_events_are_parsed_and_a_malformed_line_is_reported_not_raised():
    good = ev.LogEvent(message="hi", source="tuner", time=1.0)
    seen, bad = [], []
    feed_events(
        [ev.dumps(good).encode(), b"", b"  ", b"{not json", ev.dumps(good).encode()],
        seen.append,
        lambda line, why: bad.append((line, why)),
    )
    assert seen == [good, good]
    assert len(bad) == 1 and bad[0][0] == b"{not json" and "JSON" in bad[0][1]


def test_a_replay_without_the_ui_prints_the_run_and_ends_by_itself(tmp_path):
    """MonitorSession through SessionBase.run_headless: the same loop as `gptop --no-ui train`."""
    from fixtures.streams import cpu_run
    from gptop.monitor import MonitorSession
    from gptop.session import EXIT_DONE

    run = cpu_run(20)
    (tmp_path / "events.jsonl").write_text("".join(ev.dumps(e) + "\n" for e in run if e.type != "device"))

    class NoSampler:
        def subscribe(self, fn):
            pass

        def start(self):
            pass

        def stop(self):
            pass

    class View:
        def __init__(self):
            self.events, self.statuses, self.closed = [], [], False

        def on_event(self, e):
            self.events.append(e)

        def on_log(self, line, stream):
            pass

        def on_status(self, status, message):
            self.statuses.append(status)

        def close(self):
            self.closed = True

    view = View()
    m = MonitorSession(tmp_path, sampler=NoSampler())
    assert m.run_headless(view) == EXIT_DONE
    assert view.closed and view.statuses == ["replay"] and m.finished
    assert [e for e in view.events] == [e for e in run if e.type != "device"]
