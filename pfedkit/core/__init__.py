"""The ground floor: the contract that algorithms and runtimes share (`contract`), math on
parameters (`params`) and aggregation (`aggregation`), seeded randomness (`seeds`), batch order
(`batches`), thread control (`threads`), the user-facing errors (`errors`) and the backend names
(`backends`). Nothing here imports another pfedkit package (docs/architecture.md, "Layers")."""
