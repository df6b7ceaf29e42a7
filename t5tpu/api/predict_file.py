"""T5Model.predict_file: a text file decoded into JSON lines with `t5tpu infer`'s chunks, so an
interrupted call continues where it stopped and the result is the same bytes either way."""

from __future__ import annotations

from collections.abc import Callable

from t5tpu.runners import example_progress, infer_chunks, infer_inputs, prediction_files


def write(
    input_file: str,
    output_file: str,
    *,
    decode: Callable[[list[str], int], list[str]],
    shape: Callable[[list[str]], list[str]],
    identity: dict,
    chunk_size: int,
    shapes_inputs: bool,
) -> str:
    """Decodes `input_file` into `output_file` (see T5Model.predict_file): `shape(texts)` makes
    the model inputs, `decode(model_inputs, first)` their predictions, which depend on what
    `identity` says (model, settings); each line has the model input too when `shapes_inputs`."""
    source = infer_inputs.from_files(input_file, None)
    manifest = {"inputs": source.fingerprint, "chunk_size": chunk_size, **identity}
    store = infer_chunks.ChunkStore(output_file, manifest)
    done = store.open(writer=True)
    progress = example_progress.ExampleProgress(
        "predict_file", total=source.total, already=sum(s.end - s.start for s in done)
    )
    assignment = infer_chunks.Assignment(chunk_size)
    for span, records in infer_chunks.pieces(source.read(), assignment=assignment, done=done):
        texts = [record.text for record in records]
        model_inputs = shape(texts)
        predictions = decode(model_inputs, span.start)
        lines = [
            prediction_files.json_line(text, prediction, model_input=shown)
            for text, prediction, shown in zip(
                texts,
                predictions,
                model_inputs if shapes_inputs else [None] * len(texts),
                strict=True,
            )
        ]
        store.write(span, lines)
        progress.add(len(records))
    store.record_end(source.total)
    store.merge(store.complete())
    return output_file
