"""Breeze-TTS-2 as plain nn.Modules: tensors and attention metadata in, tensors out.

Must not: know about requests, scheduling, CUDA graphs or sampling policy.
"""
