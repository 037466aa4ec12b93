"""The live stream's ordering: checks and evaluations just before their step, held while their step is unread,
a state change after its batch's steps, and `Item.after` (what a joining viewer takes from the shared feed)."""

from __future__ import annotations

from app.api.live_order import BATCH, Item, Sequencer, full
from app.store.live_reads import StreamBatch


def kinds(items: list[Item]) -> list[tuple[str, int]]:
    return [(item.kind, item.step) for item in items]


def test_a_check_waits_for_its_step_and_goes_just_before_it() -> None:
    sequencer = Sequencer(0)
    first = sequencer.feed(StreamBatch(checks=[(2, "c2"), (4, "c4")], steps=[(1, "s1"), (2, "s2"), (3, "s3")],
                                       evaluations=[(3, "e3")]))
    assert kinds(first) == [("metrics", 1), ("layers", 2), ("metrics", 2), ("evaluation", 3), ("metrics", 3)]
    assert [step for step, _ in sequencer.held] == [4] and sequencer.sent_step == 3
    second = sequencer.feed(StreamBatch(steps=[(4, "s4")], events=[("5-0", {"state": "succeeded"})]))
    assert kinds(second) == [("layers", 4), ("metrics", 4), ("state", -1)]
    assert sequencer.terminal and not sequencer.whole, "the job ended, but its streams may hold more"
    assert sequencer.feed(StreamBatch()) == [] and sequencer.whole
    assert second[1].text == "id: 4\nevent: metrics\ndata: s4\n\n"


def test_a_full_batch_of_checks_stops_the_steps_past_its_last_check() -> None:
    sequencer = Sequencer(0)
    checks = [(step, f"c{step}") for step in range(1, BATCH + 1)]
    found = StreamBatch(checks=checks, steps=[(step, f"s{step}") for step in range(1, BATCH + 3)])
    items = sequencer.feed(found)
    assert full(found) and sequencer.sent_step == BATCH, "the steps after the last check read wait for the next read"
    assert kinds(items)[-2:] == [("layers", BATCH), ("metrics", BATCH)]
    again = sequencer.feed(StreamBatch(checks=[(BATCH + 1, "late")], steps=[(BATCH + 1, "s"), (BATCH + 2, "s")]))
    assert kinds(again) == [("layers", BATCH + 1), ("metrics", BATCH + 1), ("metrics", BATCH + 2)]


def test_a_viewer_takes_from_the_shared_feed_only_what_lies_past_what_it_sent() -> None:
    feed = Sequencer(10, "7-0").feed(StreamBatch(checks=[(12, "c12")], steps=[(11, "s"), (12, "s"), (13, "s")],
                                                 events=[("8-0", {"state": "running"})]))
    taken = [item for item in feed if item.after(11, (7, 0))]
    assert kinds(taken) == [("layers", 12), ("metrics", 12), ("metrics", 13), ("state", -1)]
    assert [item for item in feed if item.after(13, (8, 0))] == []
