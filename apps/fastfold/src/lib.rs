//! AlphaFold 2 monomer inference: input features, residue tables, the model and PDB output.
pub mod features;
pub mod pdb;
pub mod residue_constants;
