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


def test_terminal_lines_are_what_a_terminal_shows_in_bounded_memory():
    """A program's output as its terminal shows it: a line redrawn with carriage returns (tqdm's bar) is its
    last drawing; a bar still being redrawn is given out as its latest complete drawing at most every redraw_s,
    and holds no more than two drawings however long it runs; a CRLF ending is a plain end."""
    from gptop.tail import TerminalLines

    now = [0.0]
    lines = TerminalLines(redraw_s=10.0, max_line=64, clock=lambda: now[0])
    assert lines.feed(b"plain\nwindows\r\nhalf") == [b"plain", b"windows"]
    assert lines.feed(b" done\n") == [b"half done"]
    out = []
    for i in range(10_000):
        out += lines.feed(f"\r{i:5d}/10000 |bar|".encode())
        now[0] += 0.01  # 100 redraws a second for 100 s
    assert len(out) == 9 and all(x.endswith(b"/10000 |bar|") for x in out)  # one every 10 s, in order
    assert [int(x.split(b"/")[0]) for x in out] == sorted(int(x.split(b"/")[0]) for x in out)
    assert len(lines.rest() or b"") <= 64  # only the latest drawing was kept
    lines.feed(b"\r 1/2 |bar|")
    assert lines.feed(b"\r 2/2 |bar|\n") == [b" 2/2 |bar|"]  # the bar's end: its final drawing, once
    assert lines.feed(b"x" * 100) == [b"x" * 100]  # a line longer than max_line without a newline: given out
    assert lines.feed(b"tail") == [] and lines.rest() == b"tail"


def test_a_file_tail_of_a_programs_output_uses_its_splitter(tmp_path):
    from gptop.tail import FileTail, TerminalLines

    log = tmp_path / "trainer.stderr.log"
    log.write_bytes(b"\r10%\r20%\r100%\nTraceback\n")
    assert FileTail(log, lines=TerminalLines()).read_all() == [b"100%", b"Traceback"]
    assert FileTail(log).read_all() == [b"\r10%\r20%\r100%", b"Traceback"]  # events' lines are not drawings
