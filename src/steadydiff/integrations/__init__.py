"""Integrations with the ecosystem's own libraries (optional extras).

``integrations.sd``: the Stable Diffusion family through diffusers, transformers and peft
(``pip install steadydiff[sd]``; docs/sd.md).
"""
