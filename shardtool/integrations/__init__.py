"""Adapters that let a `ShardedLoader` live inside other people's training loops.

One module per trainer, each imported by name (``shardtool.integrations.lightning``); this
package imports nothing itself, so ``import shardtool`` never pulls in torch or a trainer.
"""
