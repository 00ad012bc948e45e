"""The main job: train a small GPT data-parallel on N real workers and report loss, bytes and
time over slow links (`thinwire train`, `thinwire compare`).

Modules: config (presets, link parsing), model (GPT), data (embedded stdlib corpus, text,
.bin), optimizers (the registry: name -> factory + default lr), powersgd (PyTorch's DDP hook,
bytes counted), worker (one rank's loop), run (compare / train), report (modelled time,
time to target, table, plots), netns (emulated link), launch (gloo processes, torchrun),
sites (--sites: FSDP2 inside a site, the optimizer across sites, bytes per tier).
"""
