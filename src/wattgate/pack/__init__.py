"""Pack-and-balance: documents -> packs -> (epoch, step, micro, rank, slot), equal on every rank."""
