"""Datasets: JSONL and Parquet, globs of them, `datasets` folders written by save_to_disk, slices, streaming blocks,
the seeded epoch order, chat templates, bad rows."""

import asyncio
import json
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from services.buffer.datasets import DatasetError, open_blocks, read_block
from services.buffer.prompts import RowSpec, Skipped, check_rows, prepare_rows
from services.buffer.source import Cursor, PromptStream
from slipstream.v1 import common_pb2
from tests.buffer.conftest import write_jsonl


def rows_of(spec: str, streaming: bool = False, block_bytes: int = 1 << 20) -> list:
    return [json.loads(r.data) if isinstance(r.data, bytes) else r.data
            for b in open_blocks(spec, streaming, block_bytes) for r in read_block(b)]  # fmt: skip


@pytest.fixture
def numbered(tmp_path):
    return write_jsonl(tmp_path / "n.jsonl", [{"prompt": f"p{i}", "i": i} for i in range(50)])


def test_jsonl_slices(numbered):
    assert [r["i"] for r in rows_of(str(numbered))] == list(range(50))
    assert [r["i"] for r in rows_of(f"{numbered}@[10:13]")] == [10, 11, 12]
    assert [r["i"] for r in rows_of(f"{numbered}@[45:]")] == list(range(45, 50))
    assert [r["i"] for r in rows_of(f"{numbered}@[:2]", streaming=True, block_bytes=16)] == [0, 1]


def test_streaming_jsonl_blocks_cover_every_row_once(numbered):
    blocks = open_blocks(str(numbered), streaming=True, block_bytes=64)
    assert len(blocks) > 5
    assert [r["i"] for r in rows_of(str(numbered), streaming=True, block_bytes=64)] == list(range(50))
    assert [r["i"] for r in rows_of(f"{numbered}@[7:31]", streaming=True, block_bytes=64)] == list(range(7, 31))


def test_parquet_row_groups_and_slices(tmp_path):
    path = tmp_path / "d.parquet"
    table = pa.table({"prompt": [f"p{i}" for i in range(30)], "i": list(range(30))})
    pq.write_table(table, path, row_group_size=7)
    assert [r["i"] for r in rows_of(str(path))] == list(range(30))
    assert len(open_blocks(str(path), streaming=True)) == 5
    assert [r["i"] for r in rows_of(f"{path}@[5:16]", streaming=True)] == list(range(5, 16))
    assert [r["i"] for r in rows_of(f"{path}@[-3:]")] == [27, 28, 29]


def test_empty_missing_and_unsupported(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DatasetError, match="has no rows"):
        open_blocks(str(tmp_path / "empty.jsonl"), False)
    with pytest.raises(DatasetError, match="does not exist"):
        open_blocks(str(tmp_path / "none.jsonl"), False)
    (tmp_path / "d.csv").write_text("a\n")
    with pytest.raises(DatasetError, match=r"use \.jsonl or \.parquet"):
        open_blocks(str(tmp_path / "d.csv"), False)


def test_a_glob_reads_its_files_in_name_order_and_a_slice_takes_one_file(tmp_path, numbered):
    parts = tmp_path / "parts"
    parts.mkdir()
    write_jsonl(parts / "b.jsonl", [{"prompt": "b", "i": 1}])
    pq.write_table(pa.table({"prompt": ["c", "d"], "i": [2, 3]}), parts / "c.parquet")
    write_jsonl(parts / "a.jsonl", [{"prompt": "a", "i": 0}])
    assert [r["i"] for r in rows_of(str(parts / "*"))] == [0, 1, 2, 3]
    assert [r["i"] for r in rows_of(str(parts / "*.jsonl"), streaming=True, block_bytes=8)] == [0, 1]
    assert [r["i"] for r in rows_of(str(tmp_path / "**" / "*.parquet"))] == [2, 3]
    with pytest.raises(DatasetError, match=r"a slice @\[a:b\] takes one file, and .*\*\.jsonl has 2"):
        open_blocks(f"{parts / '*.jsonl'}@[0:1]", False)
    with pytest.raises(DatasetError, match="no file matches"):
        open_blocks(str(parts / "*.json"), False)


def test_a_folder_saved_by_datasets_is_read_row_by_row(tmp_path):
    import datasets

    rows = [{"prompt": f"p{i}", "label": str(i)} for i in range(40)]
    datasets.Dataset.from_list(rows).save_to_disk(tmp_path / "saved", num_shards=3)
    assert len(list((tmp_path / "saved").glob("*.arrow"))) == 3  # read in the folder's order
    assert rows_of(str(tmp_path / "saved")) == rows
    assert read_block(open_blocks(str(tmp_path / "saved"), False)[1])[2].where.endswith(".arrow row 2")
    datasets.Dataset.from_list(rows).save_to_disk(tmp_path / "one")
    assert rows_of(f"{tmp_path / 'one'}@[3:5]") == rows[3:5]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(tmp_path / "splits")
    with pytest.raises(DatasetError, match=r"holds the splits train of a DatasetDict; name one, e.g. .*splits/train"):
        open_blocks(str(tmp_path / "splits"), False)
    assert rows_of(str(tmp_path / "splits" / "train")) == rows
    with pytest.raises(DatasetError, match="not one written by datasets' save_to_disk"):
        open_blocks(str(tmp_path), False)


async def stream_ids(stream: PromptStream, cursor: Cursor | None = None) -> list[str]:
    stream.reset(cursor or Cursor())
    return [item.group_id for item in await stream.take(10_000)]


@pytest.mark.parametrize("streaming", [False, True])
async def test_seeded_epoch_order_is_a_permutation_and_repeats_after_restart(numbered, tokenizer_dir, streaming):
    spec = RowSpec(str(tokenizer_dir))
    blocks = open_blocks(str(numbered), streaming, block_bytes=100)
    stream = PromptStream("train", blocks, spec, None, seed=3, shuffle=True, num_epoch=2)
    ids = await stream_ids(stream)
    assert len(ids) == 100 and len(set(ids)) == 100
    first, second = ids[:50], ids[50:]
    assert first != [i.replace(":e1:", ":e0:") for i in second]  # each epoch is reshuffled
    again = PromptStream("train", blocks, spec, None, seed=3, shuffle=True, num_epoch=2)
    stream.reset(Cursor())
    middle = (await stream.take(17))[-1].after
    assert await stream_ids(again, middle) == ids[17:]


async def test_data_worker_processes_tokenize(numbered, tokenizer_dir):
    spec = RowSpec(str(tokenizer_dir))
    with ProcessPoolExecutor(2, mp_context=get_context("spawn")) as pool:
        stream = PromptStream("train", open_blocks(str(numbered), False), spec, pool, 0, False, 1, chunk_rows=8)
        items = await stream.take(50)
    group = common_pb2.PromptGroup.FromString(items[3].payload)
    assert group.prompt_text == "p3" and len(group.prompt_tokens) > 0 and len(items) == 50


def test_chat_template_with_tools_and_kwargs(tmp_path, tokenizer_dir):
    path = write_jsonl(tmp_path / "chat.jsonl", [{
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"}],
        "tools": json.dumps([{"name": "calculator"}]),
    }])  # fmt: skip
    spec = RowSpec(str(tokenizer_dir), input_key="messages", tool_key="tools", apply_chat_template=True,
                   chat_template_kwargs={"enable_thinking": False})  # fmt: skip
    (payload,) = prepare_rows(read_block(open_blocks(str(path), False)[0]), spec)
    group = common_pb2.PromptGroup.FromString(payload)
    assert group.prompt_text == (
        '<|im_start|>system\nYou can call these tools:\n{"name": "calculator"}<|im_end|>\n'
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n1+1?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert json.loads(group.tools_json) == [{"name": "calculator"}]


def test_string_prompt_through_the_chat_template(tmp_path, tokenizer_dir):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi"}])
    (payload,) = prepare_rows(
        read_block(open_blocks(str(path), False)[0]), RowSpec(str(tokenizer_dir), apply_chat_template=True)
    )
    assert (
        common_pb2.PromptGroup.FromString(payload).prompt_text
        == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_long_prompts_are_skipped_and_say_why(tmp_path, tokenizer_dir):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "short"}, {"prompt": "long " * 100}])
    results = prepare_rows(read_block(open_blocks(str(path), False)[0]), RowSpec(str(tokenizer_dir), max_prompt_len=20))
    assert isinstance(results[0], bytes)
    assert isinstance(results[1], Skipped) and results[1].reason == "prompt_too_long"
    assert "p.jsonl line 2" in results[1].message


@pytest.mark.parametrize(
    ("line", "spec", "message"),
    [
        ('{"question": "x", "answer": 1}', {},
         'line 2: field "prompt" missing (keys present: answer, question); pass --input-key'),
        ('{"prompt": "x"}', {"label_key": "answer"},
         'line 2: field "answer" missing (keys present: prompt); pass --label-key'),
        ("{not json", {}, "p.jsonl line 2: not valid JSON"),
        ('["a"]', {}, "p.jsonl line 2: a row must be a JSON object, not list"),
        ('{"prompt": 5}', {}, 'p.jsonl line 2: field "prompt" must be a string or a list of chat messages'),
        ('{"prompt": [{"role": "user", "content": "x"}]}', {},
         "line 2: the prompt is a list of chat messages; pass --apply-chat-template"),
        ('{"prompt": "x", "metadata": 3}', {}, 'p.jsonl line 2: field "metadata" must be a JSON dict, not int'),
    ],
)  # fmt: skip
def test_bad_rows_name_the_file_line_and_fix(tmp_path, tokenizer_dir, line, spec, message):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "fine", "answer": "1"}\n' + line + "\n")
    rows = read_block(open_blocks(str(path), False)[0])
    with pytest.raises(DatasetError) as info:
        check_rows(rows, RowSpec(str(tokenizer_dir), **spec))
    assert message in str(info.value)
    assert check_rows(rows, RowSpec(str(tokenizer_dir), skip_invalid_rows=True, **spec)) == 1


def test_streaming_errors_still_name_the_line(tmp_path, tokenizer_dir):
    path = write_jsonl(tmp_path / "s.jsonl", [{"prompt": f"p{i}"} for i in range(30)] + ["{broken"])
    last_block = open_blocks(str(path), True, block_bytes=40)[-1]
    with pytest.raises(DatasetError, match=r"s\.jsonl line 31: not valid JSON"):
        prepare_rows(read_block(last_block), RowSpec(str(tokenizer_dir)))


def test_first_lease_of_a_large_streaming_file_reads_only_its_block(tmp_path, tokenizer_dir, monkeypatch):
    import services.buffer.source as source

    path = write_jsonl(tmp_path / "big.jsonl", [{"prompt": f"p{i}"} for i in range(20_000)])
    blocks = open_blocks(str(path), streaming=True, block_bytes=4096)
    reads = []
    monkeypatch.setattr(source, "read_block", lambda block: reads.append(block) or read_block(block))
    stream = PromptStream("train", blocks, RowSpec(str(tokenizer_dir)), None, 1, True, None, chunks_ahead=1)
    items = asyncio.run(stream.take(4))
    assert len(items) == 4 and len(blocks) > 50 and len(reads) == 1
