"""DeepSeek-style decoders: multi-head latent attention (MLA) and mixture-of-experts (MoE), as DeepSeek-V2/V3 and LongCat-Flash use them."""
