"""The Stable Diffusion family through diffusers, transformers and peft (docs/sd.md).

Needs the ``sd`` extra (``pip install steadydiff[sd]``); importing a module here without it
raises an ImportError that says so.
"""
