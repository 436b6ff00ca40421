"""The checks, the simulator's top storey (DESIGN.md section 3): the simulator against real runs
(`validate`) and against the papers' published numbers (the reproductions). Imports the studies, the
model and the contract; nothing in sim/ imports them."""
