"""A custom loss (`--loss-type custom_loss --custom-loss-function-path examples/slime_plugins/loss.py:reinforce_loss`)
written as slime's are: `fn(args, batch, logits, sum_of_sample_mean) -> (loss, metrics)`.

REINFORCE with the batch's advantages: the log-probs of the response tokens are taken from `logits` (`[1, T, V]`,
the micro-batch's sequences one after another), and the loss is -mean(advantage * log-prob) over the trained tokens.
With tensor parallelism the logits are split over the vocabulary, as in slime; this example is for TP 1.
"""

import torch


def reinforce_loss(args, batch, logits, sum_of_sample_mean):
    log_probs, offset = [], 0
    for tokens, total, response in zip(
        batch["unconcat_tokens"], batch["total_lengths"], batch["response_lengths"], strict=True
    ):
        # the logits at position t predict token t + 1: the response's come from the positions just before it
        rows = logits[0, offset + total - response - 1 : offset + total - 1].float()
        log_probs.append(torch.log_softmax(rows, dim=-1).gather(-1, tokens[total - response :, None].long())[:, 0])
        offset += total
    log_probs = torch.cat(log_probs)
    advantages = torch.cat(batch["advantages"])
    pg_loss = sum_of_sample_mean(-advantages * log_probs)
    return pg_loss, {"loss": pg_loss.detach(), "pg_loss": pg_loss.detach(), "log_prob": sum_of_sample_mean(log_probs)}
