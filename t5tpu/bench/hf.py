"""`t5tpu bench --compare_hf`: the same workloads through Hugging Face transformers' PyTorch
T5ForConditionalGeneration of the same geometry (random weights, AdamW), in the same process."""

from __future__ import annotations

import numpy as np

from t5tpu.bench.report import decode_result, throughput
from t5tpu.bench.timing import Workload
from t5tpu.errors import UserError


def hf_model(config, dtype: str):
    """transformers' T5ForConditionalGeneration with the same geometry and random weights."""
    import torch
    import transformers

    if config.mlp_activations not in (("gelu", "linear"), ("relu",)):
        raise UserError(
            f"--compare_hf supports T5 1.0/1.1 feed-forwards, not {config.mlp_activations}"
        )
    hf_config = transformers.T5Config(
        vocab_size=config.vocab_size,
        d_model=config.emb_dim,
        d_kv=config.head_dim,
        d_ff=config.mlp_dim,
        num_layers=config.num_encoder_layers,
        num_decoder_layers=config.num_decoder_layers,
        num_heads=config.num_heads,
        relative_attention_num_buckets=config.relative_attention_num_buckets,
        relative_attention_max_distance=config.relative_attention_max_distance,
        dropout_rate=config.dropout_rate,
        feed_forward_proj="gated-gelu" if len(config.mlp_activations) == 2 else "relu",
        tie_word_embeddings=config.logits_via_embedding,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
    )
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(hf_config)
    return model.to(getattr(torch, dtype))


def hf_train(model, args, batch) -> Workload:
    import torch

    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
    inputs = torch.as_tensor(batch["encoder_input_tokens"], dtype=torch.long)
    labels = torch.as_tensor(batch["decoder_target_tokens"], dtype=torch.long)

    def step():
        loss = model(input_ids=inputs, attention_mask=inputs > 0, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def report(seconds: float) -> dict:
        return throughput(seconds, args.batch_size, args.input_length + args.target_length)

    return Workload(step, report)


def hf_score(model, args, batch) -> Workload:
    import torch

    inputs = torch.as_tensor(batch["encoder_input_tokens"], dtype=torch.long)
    decoder_inputs = torch.as_tensor(batch["decoder_input_tokens"], dtype=torch.long)
    targets = torch.as_tensor(batch["decoder_target_tokens"], dtype=torch.long)

    @torch.inference_mode()
    def score():
        model.eval()
        logits = model(
            input_ids=inputs, attention_mask=inputs > 0, decoder_input_ids=decoder_inputs
        ).logits
        log_p = torch.log_softmax(logits.float(), dim=-1)
        log_p.gather(-1, targets[..., None])[..., 0].sum(-1)

    def report(seconds: float) -> dict:
        return throughput(seconds, args.batch_size, args.input_length + args.target_length)

    return Workload(score, report)


def hf_decode(model, args, inputs: np.ndarray, settings) -> Workload:
    """generate() with its KV cache and the same decoding settings (DecodingSettings);
    min_new_tokens keeps EOS from ending rows early."""
    import torch

    ids = torch.as_tensor(inputs, dtype=torch.long)
    length, num_beams = args.decode_length, settings.num_beams
    beam_options = {"num_beams": num_beams, "do_sample": settings.samples}
    if num_beams > 1:
        beam_options["length_penalty"] = settings.beam_alpha
    if settings.samples:  # top_k 0 is no top-k in both (HF's default would be 50)
        beam_options |= {"temperature": settings.temperature, "top_k": settings.top_k}

    @torch.inference_mode()
    def generate():
        model.eval()
        return model.generate(
            input_ids=ids,
            attention_mask=ids > 0,
            max_new_tokens=length,
            min_new_tokens=length,
            use_cache=True,
            **beam_options,
        )

    produced = generate().shape[1] - 1  # generate() returns the start token too
    if produced != length:
        raise RuntimeError(f"HF generate produced {produced} tokens, not {length}")

    def report(seconds: float) -> dict:
        return decode_result(seconds, len(inputs), args, num_beams)

    def run():
        generate()  # torch ran eagerly: nothing is left to wait for

    return Workload(run, report)
