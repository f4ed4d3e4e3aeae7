"""Training one worker group: micro-batching and log-probs, the loss, the training engines
(torch, DeepSpeed ZeRO 0-3) behind one protocol, and optimizer state saved between stages."""
