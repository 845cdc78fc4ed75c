"""``breezert-bench``: load generator, simulated listener and reports for the serving benchmark.

Owns: the workload (``workload``), per-request playback math (``listener``), variants as config
overrides (``variants``), options and metadata (``options``), where a run ran (``provenance``:
GPU, versions, commit, date; the scripts under ``bench/`` record theirs with it too), driving
engines under closed/open loop load (``runner``) and JSON/markdown/PNG output (``report``).
Must not: change engine behaviour; variants only set config flags. Importing this package is
torch-free.
"""
