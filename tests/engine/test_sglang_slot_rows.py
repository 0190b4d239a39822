"""The SGLang backend's request-to-token table (`SlotRows`) lasts across steps: a decode
step writes one slot per sequence, never a sequence's whole table again, and every row
still lists exactly the slots of its sequence's pages, through chunked prefills, prefix
hits, preemption and finished sequences whose rows are reused. Needs no SGLang."""

from conftest import random_prompts

from omniflow.engine import SamplingParams
from omniflow.engine.scheduler import ScheduledChunk, Scheduler
from omniflow.engine.sequence import Sequence
from omniflow.engine.sglang_backend import SlotRows
from omniflow.kv.radix import RadixPrefixCache

PAGE = 4


def expected_slots(sequence: Sequence, end: int) -> list[int]:
    return [sequence.page_ids[i // PAGE] * PAGE + i % PAGE for i in range(end)]


def test_rows_grow_by_the_new_tokens_and_match_the_pages():
    allocator = RadixPrefixCache(64, PAGE)
    scheduler = Scheduler(allocator, max_num_seqs=3, max_num_batched_tokens=8)
    rows = SlotRows(PAGE)
    a, b, d = random_prompts((20, 13, 11), seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    # The third shares A's first 16 tokens: admitted after A, it starts from cached pages.
    sequences = [
        Sequence("a", a, params),
        Sequence("b", b, params),
        Sequence("c", a[:16] + d, params),
    ]
    scheduler.add(sequences[0])
    scheduler.add(sequences[1])
    steps = decode_steps = preempted = prefix_hits = 0
    while scheduler.has_unfinished():
        chunks = scheduler.schedule()
        before = rows.slots_written
        indices = rows.rows_for(chunks)
        assert len(set(indices)) == len(indices)
        assert max(indices) < 3  # rows of ended sequences are reused
        for chunk, row in zip(chunks, indices, strict=True):
            end = chunk.start + chunk.num_tokens
            assert rows.req_to_token[row, :end].tolist() == expected_slots(chunk.sequence, end)
            assert (
                rows.slots(row, chunk.start, end).tolist()
                == expected_slots(chunk.sequence, end)[chunk.start :]
            )
            prefix_hits += chunk.sequence is sequences[2] and chunk.start == 16
        if all(c.num_tokens == 1 and c.start > 0 for c in chunks):
            assert rows.slots_written - before == len(chunks)  # one slot each
            decode_steps += 1
        scheduler.commit(chunks)
        for chunk in chunks:
            sequence = chunk.sequence
            if chunk.samples:
                sequence.append_token(int(sequence.token_ids[-1]) % 7 + 1, 0.0, None)
                if len(sequence.output_token_ids) >= params.max_tokens:
                    scheduler.finish(sequence, "length")
                    if sequence is sequences[0]:
                        scheduler.add(sequences[2])
        steps += 1
        if steps == 6:  # B loses its pages and comes back later: its row is written anew
            scheduler.preempt(sequences[1])
            preempted += 1
    assert decode_steps > 10 and preempted and prefix_hits == 1
    assert sequences[1].num_preemptions == 1
    assert all(len(s.output_token_ids) == params.max_tokens for s in sequences)


def test_a_row_is_written_anew_when_its_pages_change():
    """Preempted and admitted again in one schedule, with a prefix hit on other pages: the
    row's first slots came from pages the sequence no longer holds."""
    rows = SlotRows(PAGE)
    [prompt] = random_prompts((12,), seed=4)
    sequence = Sequence("s", prompt, SamplingParams(max_tokens=4))
    sequence.page_ids = [5, 6, 7]
    [row] = rows.rows_for([ScheduledChunk(sequence, 0, 12)])
    assert rows.req_to_token[row, :12].tolist() == expected_slots(sequence, 12)
    sequence.page_ids = [9, 2, 7]  # a new list: freed, then matched again
    [row] = rows.rows_for([ScheduledChunk(sequence, 8, 4)])
    assert rows.req_to_token[row, :12].tolist() == expected_slots(sequence, 12)
    sequence.page_ids.append(4)  # appended in place: the row goes on from its slots
    before = rows.slots_written
    [row] = rows.rows_for([ScheduledChunk(sequence, 12, 1)])
    assert rows.req_to_token[row, :13].tolist() == expected_slots(sequence, 13)
    assert rows.slots_written - before == 1
