"""HunyuanImage-3.0 as published: the MoE backbone (model.py, config.py), its image parts
(parts.py: VAE vae.py, SigLIP2 ViT vit.py, timestep embedders and the UNet patch ends), the
release's sequence template (template.py, tokens.py) and the denoise loop (denoise.py)."""
