"""The run model, the simulator's lowest storey (DESIGN.md section 3): one iteration (`iteration`), one
run (`run`, the event model; `closed_form`, the engine that evaluates it by default), the recovery
policies (`methods`) and what a run returns (`results`). Imports only the contract (`calibration/`)."""
