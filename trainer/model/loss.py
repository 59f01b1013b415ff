"""The training loss: the summed token cross-entropy of a T5-style seq2seq LM (`Seq2SeqLMLoss`), padded
or packed batches, through the chunked LM-head cross-entropy (trainer.kernels.cross_entropy)."""

from __future__ import annotations

import torch

from trainer.kernels.cross_entropy import linear_cross_entropy
from trainer.model.model_shape import scales_decoder_outputs
from trainer.model.packed_t5 import one_record_per_row, packed_loss_sum


class Seq2SeqLMLoss(torch.nn.Module):
    """A T5-style model whose forward is the training loss: the sum of target-token cross-entropies (fp32).

    Runs the encoder and decoder as `T5ForConditionalGeneration.forward` does (decoder inputs are the labels
    shifted right; decoder outputs scaled by d_model**-0.5 where the model does so) and feeds the decoder's
    last hidden states to `linear_cross_entropy` with the LM head's weight. A packed batch (one with
    `encoder_segment_ids`: several records per row) goes through trainer.model.packed_t5 instead, with the
    same result: the sum of its records' losses; with the Triton attention so does a padded batch, as rows of
    one record each (its kernels take no dense bias). Call it with the batch's tensors as keywords,
    `loss_module(**batch)`. Under FSDP, wrap this module (not the inner model), so its hooks see the whole
    step.
    """

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(
        self,
        input_ids,
        attention_mask,
        labels,
        encoder_segment_ids=None,
        decoder_segment_ids=None,
        encoder_positions=None,
        decoder_positions=None,
    ) -> torch.Tensor:
        m = self.model
        if encoder_segment_ids is None and m.encoder.config._attn_implementation == "triton":
            encoder_segment_ids, decoder_segment_ids, decoder_positions = one_record_per_row(
                attention_mask, labels
            )
        if encoder_segment_ids is not None:  # packed: attention_mask and positions follow from the segments
            return packed_loss_sum(
                m, input_ids, labels, encoder_segment_ids, decoder_segment_ids, decoder_positions
            )
        encoder_hidden = m.encoder(input_ids=input_ids, attention_mask=attention_mask)[0]
        decoder_hidden = m.decoder(
            input_ids=m.prepare_decoder_input_ids_from_labels(labels=labels),
            encoder_hidden_states=encoder_hidden,
            encoder_attention_mask=attention_mask,
            use_cache=False,
        )[0]
        if scales_decoder_outputs(m.config):
            decoder_hidden = decoder_hidden * (m.config.d_model**-0.5)
        return linear_cross_entropy(decoder_hidden, m.get_output_embeddings().weight, labels)


def token_loss_sum(model, batch: dict):
    """Sum of target-token cross-entropies of `batch` (fp32), without HF's per-batch mean.

    `model` is the HF model, or the `Seq2SeqLMLoss` around it that FSDP wraps (so that its hooks see the
    whole step). Every key of the batch goes to the loss module: a packed batch's segment ids and positions
    select the packed path."""
    if not isinstance(model, Seq2SeqLMLoss):
        model = Seq2SeqLMLoss(model)
    return model(**batch)
