"""The progress line: redrawn in place on a terminal, plain log lines elsewhere."""

import io
import logging

from rlexp.progress import ERASE_LINE, Progress, SweepPosition


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_in_a_log_file_progress_is_plain_lines_with_step_eta_reward_and_eval(caplog):
    stream = io.StringIO()
    caplog.set_level(logging.INFO, logger="rlexp")
    p = Progress(total_steps=4, stream=stream, every_s=0.0,
                 sweep=SweepPosition(job=1, jobs=3, started=0.0, name="staleness_threshold=2"))
    p.evaluated(0, 0.25)
    for step in (1, 2):
        p.update(step, reward=0.5)
    p.close()
    lines = [r.getMessage() for r in caplog.records]
    assert lines[-1].startswith("progress: step 2/4 50% | ")
    assert "ETA " in lines[-1] and "reward 0.500" in lines[-1] and "eval 0.250 @0" in lines[-1]
    assert "job 2/3 staleness_threshold=2, sweep ETA" in lines[-1]
    assert stream.getvalue() == ""  # nothing drawn: not a terminal
    assert not any("\x1b" in line or "\r" in line for line in lines)


def test_on_a_terminal_the_line_stays_below_the_log_records():
    term = Terminal()
    handler = logging.StreamHandler(term)
    logger = logging.getLogger("rlexp")
    logger.addHandler(handler)
    try:
        p = Progress(total_steps=10, stream=term)
        p.update(3, reward=0.1)
        logger.warning("a record")
        p.update(4, reward=0.2)
        p.close()
    finally:
        logger.removeHandler(handler)
    out = term.getvalue()
    first, record, redrawn = out.split(ERASE_LINE)[1:4]
    assert first.startswith("step 3/10 30%")
    assert record == "a record\n"           # the status line was erased before the record
    assert redrawn.startswith("step 3/10")  # ... and drawn again below it
    assert out.split(ERASE_LINE)[4].startswith("step 4/10") and out.endswith(ERASE_LINE)  # erased at close
    assert handler.stream is term           # the console handler is given back its stream
