"""What mega-muon registers, by import path: listing plugins does not import the optimizer."""

from mega.core.plugins import hookimpl


@hookimpl
def register_optimizers(register):
    register("muon", "mega_muon.muon:muon",
             "Muon (Newton-Schulz orthogonalised momentum) for hidden matrices, AdamW for the rest")
