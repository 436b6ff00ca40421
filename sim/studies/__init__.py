"""The studies, the simulator's middle storey (DESIGN.md section 3): what runs the model many times
and answers from the runs (replications, what-if, sweep, recommend, the verdict, the outputs).
Imports the model and the contract, never the checks."""
