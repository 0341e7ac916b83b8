//! AlphaFold's residue and atom tables (`alphafold/common/residue_constants.py`), as data.
//!
//! Residue types are indexed in AlphaFold's `restypes` order (the 3-letter codes sorted
//! alphabetically, `ARNDCQEGHILKMFPSTWYV`), with 20 = `X`/`UNK` and, in MSAs, 21 = gap and
//! 22 = the masked-MSA token. Atoms come in two layouts: atom37 (one slot for every heavy-atom
//! name any residue has, [`ATOM_TYPES`]) and atom14 (a residue's own atoms packed into 14
//! slots, [`RESTYPE_NAME_TO_ATOM14_NAMES`]). The literal tables below are transcribed from
//! AlphaFold; the index tables and the rigid-group frames are computed from them here the way
//! AlphaFold computes them, so there is a single source for each fact; [`stereo_chemistry`] has
//! the bond lengths and angles the structural-violation checks read, [`bounds`] what they
//! derive from them. [`Tables::new`] puts what the model needs on a device as tensors.
pub mod bounds;
mod literature;
pub mod stereo_chemistry;

pub use literature::*;

use tch::{Device, Tensor};

/// The 20 standard residue types, in AlphaFold's order.
pub const RESTYPES: [char; 20] =
    ['A', 'R', 'N', 'D', 'C', 'Q', 'E', 'G', 'H', 'I', 'L', 'K', 'M', 'F', 'P', 'S', 'T', 'W', 'Y', 'V'];

/// Number of standard residue types.
pub const RESTYPE_NUM: usize = 20;

/// Index of the unknown residue type `X` (`UNK`).
pub const UNK_RESTYPE_INDEX: usize = 20;

/// The 21 residue types of `aatype` (20 standard and `X`).
pub const RESTYPES_WITH_X: [char; 21] =
    ['A', 'R', 'N', 'D', 'C', 'Q', 'E', 'G', 'H', 'I', 'L', 'K', 'M', 'F', 'P', 'S', 'T', 'W', 'Y', 'V', 'X'];

/// The 22 classes of an AlphaFold MSA row after remapping: 21 residue types and the gap.
pub const RESTYPES_WITH_X_AND_GAP: [char; 22] =
    ['A', 'R', 'N', 'D', 'C', 'Q', 'E', 'G', 'H', 'I', 'L', 'K', 'M', 'F', 'P', 'S', 'T', 'W', 'Y', 'V', 'X', '-'];

/// Three-letter residue names by `aatype` (the 21st is `UNK`).
pub const RESNAMES: [&str; 21] = [
    "ALA", "ARG", "ASN", "ASP", "CYS", "GLN", "GLU", "GLY", "HIS", "ILE", "LEU", "LYS", "MET", "PHE", "PRO", "SER",
    "THR", "TRP", "TYR", "VAL", "UNK",
];

/// The 37 atom types of the atom37 layout, in AlphaFold's order.
pub const ATOM_TYPES: [&str; 37] = [
    "N", "CA", "C", "CB", "O", "CG", "CG1", "CG2", "OG", "OG1", "SG", "CD", "CD1", "CD2", "ND1", "ND2", "OD1", "OD2",
    "SD", "CE", "CE1", "CE2", "CE3", "NE", "NE1", "NE2", "OE1", "OE2", "CH2", "NH1", "NH2", "OH", "CZ", "CZ2", "CZ3",
    "NZ", "OXT",
];

/// Number of atom types (37).
pub const ATOM_TYPE_NUM: usize = 37;

/// The `aatype` of a residue letter (`restype_order_with_x`; any other letter is `X`).
pub fn aatype_of(letter: char) -> usize {
    RESTYPES.iter().position(|&r| r == letter.to_ascii_uppercase()).unwrap_or(UNK_RESTYPE_INDEX)
}

/// The atom37 index of an atom name (`atom_order`).
pub fn atom_order(name: &str) -> Option<usize> {
    ATOM_TYPES.iter().position(|&a| a == name)
}

/// Selenomethionine's residue name. AlphaFold reads it as methionine: its mmCIF parser gives
/// it the letter M (Biopython's `protein_letters_3to1`), and `_get_atom_positions` puts its
/// selenium (`SE`) in methionine's `SD` slot.
pub const SELENOMETHIONINE: &str = "MSE";

/// The `aatype` of a residue name that is one of the 20 amino acids, or selenomethionine (read
/// as MET); `None` for any other name.
pub fn amino_acid_aatype(residue: &str) -> Option<usize> {
    let residue = if residue == SELENOMETHIONINE { "MET" } else { residue };
    RESNAMES[..RESTYPE_NUM].iter().position(|&r| r == residue)
}

/// The atom37 index of atom `atom` of residue `residue`: its name's, except that
/// selenomethionine's selenium takes methionine's `SD` (see [`SELENOMETHIONINE`]).
pub fn residue_atom_order(residue: &str, atom: &str) -> Option<usize> {
    match atom_order(atom) {
        Some(index) => Some(index),
        None if residue == SELENOMETHIONINE && atom.eq_ignore_ascii_case("SE") => atom_order("SD"),
        None => None,
    }
}

/// HHblits' class of an MSA character (`HHBLITS_AA_TO_ID`): the 20 amino acids in
/// alphabetical one-letter order, 20 = `X` (also `J`, `O`), 21 = gap; `B`, `Z`, `U` read as
/// `D`, `E`, `C`. `None` for anything else.
pub fn hhblits_aa_to_id(c: char) -> Option<usize> {
    Some(match c {
        'A' => 0,
        'C' | 'U' => 1,
        'D' | 'B' => 2,
        'E' | 'Z' => 3,
        'F' => 4,
        'G' => 5,
        'H' => 6,
        'I' => 7,
        'K' => 8,
        'L' => 9,
        'M' => 10,
        'N' => 11,
        'P' => 12,
        'Q' => 13,
        'R' => 14,
        'S' => 15,
        'T' => 16,
        'V' => 17,
        'W' => 18,
        'Y' => 19,
        'X' | 'J' | 'O' => 20,
        '-' => 21,
        _ => return None,
    })
}

/// The character of each HHblits class (`ID_TO_HHBLITS_AA`).
pub const ID_TO_HHBLITS_AA: [char; 22] =
    ['A', 'C', 'D', 'E', 'F', 'G', 'H', 'I', 'K', 'L', 'M', 'N', 'P', 'Q', 'R', 'S', 'T', 'V', 'W', 'Y', 'X', '-'];

/// `MAP_HHBLITS_AATYPE_TO_OUR_AATYPE`: HHblits class -> index in [`RESTYPES_WITH_X_AND_GAP`].
pub fn map_hhblits_aatype_to_our_aatype() -> [usize; 22] {
    std::array::from_fn(|i| {
        let c = ID_TO_HHBLITS_AA[i];
        RESTYPES_WITH_X_AND_GAP.iter().position(|&r| r == c).unwrap_or(UNK_RESTYPE_INDEX)
    })
}

/// The MSA class (in [`RESTYPES_WITH_X_AND_GAP`] order, 0..22) of an aligned A3M character.
pub fn msa_class_of(c: char) -> Option<usize> {
    hhblits_aa_to_id(c).map(|id| map_hhblits_aatype_to_our_aatype()[id])
}

/// `restype_atom14_to_atom37`: for each residue type and atom14 slot, the atom37 index
/// (0 for an empty slot, as AlphaFold pads).
pub fn restype_atom14_to_atom37() -> [[usize; 14]; 21] {
    std::array::from_fn(|r| std::array::from_fn(|k| atom_order(RESTYPE_NAME_TO_ATOM14_NAMES[r][k]).unwrap_or(0)))
}

/// `restype_atom37_to_atom14`: for each residue type and atom37 slot, the atom14 slot (0
/// where the residue has no such atom).
pub fn restype_atom37_to_atom14() -> [[usize; 37]; 21] {
    std::array::from_fn(|r| {
        std::array::from_fn(|a| {
            let names = &RESTYPE_NAME_TO_ATOM14_NAMES[r];
            names.iter().position(|&n| !n.is_empty() && n == ATOM_TYPES[a]).unwrap_or(0)
        })
    })
}

/// `restype_atom14_mask`: 1 where a residue type has an atom in that atom14 slot.
pub fn restype_atom14_mask() -> [[f32; 14]; 21] {
    std::array::from_fn(|r| {
        std::array::from_fn(|k| f32::from(u8::from(!RESTYPE_NAME_TO_ATOM14_NAMES[r][k].is_empty())))
    })
}

/// `restype_atom37_mask` (`STANDARD_ATOM_MASK`): 1 where a residue type has that atom37 atom
/// (the residue's heavy atoms; `OXT` never; `UNK` none).
pub fn restype_atom37_mask() -> [[f32; 37]; 21] {
    std::array::from_fn(|r| {
        std::array::from_fn(|a| match RESIDUE_ATOMS.get(r) {
            Some(atoms) => f32::from(u8::from(atoms.contains(&ATOM_TYPES[a]))),
            None => 0.0,
        })
    })
}

/// `chi_angles_atom_indices`: atom37 indices of the four atoms of each chi angle, zero-padded
/// for absent angles and for `UNK`.
pub fn chi_angles_atom_indices() -> [[[usize; 4]; 4]; 21] {
    std::array::from_fn(|r| {
        std::array::from_fn(|chi| match CHI_ANGLES_ATOMS.get(r).and_then(|c| c.get(chi)) {
            Some(atoms) => atoms.map(|a| atom_order(a).unwrap_or(0)),
            None => [0; 4],
        })
    })
}

/// Rigid-group facts of one residue type, by atom14 slot.
fn rigid_group_entry(restype: usize, atom14: usize) -> Option<(usize, [f64; 3])> {
    let name = RESTYPE_NAME_TO_ATOM14_NAMES[restype][atom14];
    let atoms = RIGID_GROUP_ATOM_POSITIONS.get(restype)?;
    atoms.iter().find(|(n, _, _)| !name.is_empty() && *n == name).map(|&(_, g, p)| (g, p))
}

/// `restype_atom14_to_rigid_group`: the rigid group (0 backbone, 3 psi, 4..=7 chi1..chi4)
/// each atom14 atom moves with; 0 for empty slots.
pub fn restype_atom14_to_rigid_group() -> [[usize; 14]; 21] {
    std::array::from_fn(|r| std::array::from_fn(|k| rigid_group_entry(r, k).map_or(0, |(g, _)| g)))
}

/// `restype_atom14_rigid_group_positions`: each atom14 atom's ideal position in its rigid
/// group's frame (Angstrom); zero for empty slots.
pub fn restype_atom14_rigid_group_positions() -> [[[f32; 3]; 14]; 21] {
    std::array::from_fn(|r| {
        std::array::from_fn(|k| rigid_group_entry(r, k).map_or([0.0; 3], |(_, p)| p.map(|v| v as f32)))
    })
}

/// `restype_atom14_mask` as AlphaFold's rigid-group code builds it: 1 where a residue type
/// has an ideal position for that atom14 slot (equal to [`restype_atom14_mask`]).
pub fn restype_atom14_rigid_group_mask() -> [[f32; 14]; 21] {
    std::array::from_fn(|r| std::array::from_fn(|k| f32::from(u8::from(rigid_group_entry(r, k).is_some()))))
}

/// The `aatype` and atom14 slots of each swap of [`RESIDUE_ATOM_RENAMING_SWAPS`].
fn renaming_swaps() -> impl Iterator<Item = (usize, usize, usize)> {
    RESIDUE_ATOM_RENAMING_SWAPS.iter().flat_map(|&(resname, swaps)| {
        let r = RESNAMES.iter().position(|&n| n == resname).unwrap_or(UNK_RESTYPE_INDEX);
        let slot = move |name: &str| RESTYPE_NAME_TO_ATOM14_NAMES[r].iter().position(|&n| n == name).unwrap_or(0);
        swaps.iter().map(move |&(a, b)| (r, slot(a), slot(b)))
    })
}

/// `restype_atom14_is_ambiguous`: 1 for the atom14 atoms whose names a symmetric side chain's
/// flip exchanges ([`RESIDUE_ATOM_RENAMING_SWAPS`]).
pub fn restype_atom14_is_ambiguous() -> [[f32; 14]; 21] {
    let mut t = [[0.0; 14]; 21];
    for (r, a, b) in renaming_swaps() {
        t[r][a] = 1.0;
        t[r][b] = 1.0;
    }
    t
}

/// The renaming permutation of AlphaFold's `RENAMING_MATRICES`: for each residue type and
/// atom14 slot, the slot whose atom takes its name under the alternative naming (its swap
/// partner, else itself).
pub fn restype_atom14_renaming() -> [[usize; 14]; 21] {
    let mut t: [[usize; 14]; 21] = [std::array::from_fn(|k| k); 21];
    for (r, a, b) in renaming_swaps() {
        t[r][a] = b;
        t[r][b] = a;
    }
    t
}

/// `atom37_to_frames`'s base atoms: for each residue type and rigid group, the atom37 indices
/// of the three atoms its frame is built from (a point on the negative x axis, the origin, a
/// point in the xy plane): C, CA, N for the backbone, CA, C, O for psi, the last three atoms
/// of each chi angle; 0 for the groups a residue type does not have.
pub fn restype_rigidgroup_base_atom37_idx() -> [[[usize; 3]; 8]; 21] {
    let idx = |names: [&str; 3]| names.map(|n| atom_order(n).unwrap_or(0));
    std::array::from_fn(|r| {
        std::array::from_fn(|g| match g {
            0 => idx(["C", "CA", "N"]),
            3 => idx(["CA", "C", "O"]),
            4..=7 => match CHI_ANGLES_ATOMS.get(r).and_then(|c| c.get(g - 4)) {
                Some(&[_, a, b, c]) => idx([a, b, c]),
                None => [0; 3],
            },
            _ => [0; 3],
        })
    })
}

/// `atom37_to_frames`'s group mask: 1 for the rigid groups a residue type has (backbone, psi
/// and its chi groups; pre-omega and phi move no heavy atom and count as absent).
pub fn restype_rigidgroup_mask() -> [[f32; 8]; 21] {
    std::array::from_fn(|r| {
        std::array::from_fn(|g| match g {
            0 | 3 => 1.0,
            4..=7 => CHI_ANGLES_MASK[r][g - 4],
            _ => 0.0,
        })
    })
}

/// `atom37_to_frames`'s ambiguity mask: 1 for the last chi group of the residue types with a
/// renaming swap, whose frame the swap turns by 180° about its x axis.
pub fn restype_rigidgroup_is_ambiguous() -> [[f32; 8]; 21] {
    let mut t = [[0.0; 8]; 21];
    for &(resname, _) in &RESIDUE_ATOM_RENAMING_SWAPS {
        if let Some(r) = RESNAMES.iter().position(|&n| n == resname) {
            let chis = CHI_ANGLES_MASK[r].iter().filter(|&&m| m > 0.0).count();
            t[r][3 + chis] = 1.0;
        }
    }
    t
}

type Mat4 = [[f64; 4]; 4];

fn sub(a: [f64; 3], b: [f64; 3]) -> [f64; 3] {
    [a[0] - b[0], a[1] - b[1], a[2] - b[2]]
}

fn dot(a: [f64; 3], b: [f64; 3]) -> f64 {
    a[0] * b[0] + a[1] * b[1] + a[2] * b[2]
}

fn scale(a: [f64; 3], s: f64) -> [f64; 3] {
    a.map(|v| v * s)
}

fn identity4() -> Mat4 {
    std::array::from_fn(|i| std::array::from_fn(|j| f64::from(u8::from(i == j))))
}

/// `_make_rigid_transformation_4x4`: the frame whose x axis points along `ex`, whose y axis
/// is `ey` made orthogonal to it (Gram-Schmidt), z = x cross y, with origin `translation`;
/// columns are the axes and the translation.
pub fn make_rigid_transformation_4x4(ex: [f64; 3], ey: [f64; 3], translation: [f64; 3]) -> Mat4 {
    let x = scale(ex, 1.0 / dot(ex, ex).sqrt());
    let y = sub(ey, scale(x, dot(ey, x)));
    let y = scale(y, 1.0 / dot(y, y).sqrt());
    let z = [x[1] * y[2] - x[2] * y[1], x[2] * y[0] - x[0] * y[2], x[0] * y[1] - x[1] * y[0]];
    let mut m = identity4();
    for i in 0..3 {
        m[i][0] = x[i];
        m[i][1] = y[i];
        m[i][2] = z[i];
        m[i][3] = translation[i];
    }
    m
}

/// `restype_rigid_group_default_frame` [21, 8, 4, 4]: for each residue type, the frame of
/// each rigid group relative to its parent at zero torsion (0 backbone and 1 pre-omega are
/// the identity; 2 phi, 3 psi and 4 chi1 are relative to the backbone; chi2..chi4 to the
/// previous chi group). Computed in f64 from the ideal positions, stored as f32 as AlphaFold
/// does. `UNK` and absent chi groups keep zero matrices.
pub fn restype_rigid_group_default_frame() -> [[[[f32; 4]; 4]; 8]; 21] {
    let mut frames = [[[[0.0f32; 4]; 4]; 8]; 21];
    for (r, atoms) in RIGID_GROUP_ATOM_POSITIONS.iter().enumerate() {
        let pos = |name: &str| atoms.iter().find(|(n, _, _)| *n == name).map_or([0.0; 3], |&(_, _, p)| p);
        let mut m = [Mat4::default(); 8];
        m[0] = identity4();
        m[1] = identity4();
        m[2] = make_rigid_transformation_4x4(sub(pos("N"), pos("CA")), [1.0, 0.0, 0.0], pos("N"));
        m[3] = make_rigid_transformation_4x4(sub(pos("C"), pos("CA")), sub(pos("CA"), pos("N")), pos("C"));
        if CHI_ANGLES_MASK[r][0] > 0.0 {
            let [a0, a1, a2, _] = CHI_ANGLES_ATOMS[r][0].map(pos);
            m[4] = make_rigid_transformation_4x4(sub(a2, a1), sub(a0, a1), a2);
        }
        // Each later chi axis starts at the previous group's origin, so its frame only needs
        // the axis-end atom (in the previous group's coordinates).
        for chi in 1..4 {
            if CHI_ANGLES_MASK[r][chi] > 0.0 {
                let end = pos(CHI_ANGLES_ATOMS[r][chi][2]);
                m[4 + chi] = make_rigid_transformation_4x4(end, [-1.0, 0.0, 0.0], end);
            }
        }
        for (g, mat) in m.iter().enumerate() {
            frames[r][g] = mat.map(|row| row.map(|v| v as f32));
        }
    }
    frames
}

/// The residue tables the model needs, as tensors on one device (float32, int64 indices).
pub struct Tables {
    /// `restype_rigid_group_default_frame` [21, 8, 4, 4].
    pub default_frames: Tensor,
    /// `restype_atom14_to_rigid_group` [21, 14].
    pub group_idx: Tensor,
    /// `restype_atom14_mask` [21, 14].
    pub atom14_mask: Tensor,
    /// `restype_atom14_rigid_group_positions` [21, 14, 3].
    pub lit_positions: Tensor,
    /// `restype_atom14_to_atom37` [21, 14].
    pub atom14_to_atom37: Tensor,
    /// `restype_atom37_to_atom14` [21, 37].
    pub atom37_to_atom14: Tensor,
    /// `restype_atom37_mask` [21, 37].
    pub atom37_mask: Tensor,
    /// `chi_angles_atom_indices` [21, 4, 4] (zero rows for `UNK`).
    pub chi_angles_atom_indices: Tensor,
    /// `chi_angles_mask` [21, 4].
    pub chi_angles_mask: Tensor,
    /// `chi_pi_periodic` [21, 4].
    pub chi_pi_periodic: Tensor,
    /// `restype_atom14_is_ambiguous` [21, 14].
    pub atom14_is_ambiguous: Tensor,
    /// [`restype_atom14_renaming`] [21, 14].
    pub atom14_renaming: Tensor,
    /// [`restype_rigidgroup_base_atom37_idx`] [21, 8, 3].
    pub rigidgroup_base_atoms: Tensor,
    /// [`restype_rigidgroup_mask`] [21, 8].
    pub rigidgroup_mask: Tensor,
    /// [`restype_rigidgroup_is_ambiguous`] [21, 8].
    pub rigidgroup_is_ambiguous: Tensor,
}

fn floats(values: &[f32], shape: &[i64], device: Device) -> Tensor {
    Tensor::from_slice(values).reshape(shape).to_device(device)
}

fn indices(values: impl IntoIterator<Item = usize>, shape: &[i64], device: Device) -> Tensor {
    let v: Vec<i64> = values.into_iter().map(|x| x as i64).collect();
    Tensor::from_slice(&v).reshape(shape).to_device(device)
}

impl Tables {
    /// Builds every table on `device`.
    pub fn new(device: Device) -> Tables {
        let frames: Vec<f32> =
            restype_rigid_group_default_frame().iter().flatten().flatten().flatten().copied().collect();
        let lit: Vec<f32> = restype_atom14_rigid_group_positions().iter().flatten().flatten().copied().collect();
        Tables {
            default_frames: floats(&frames, &[21, 8, 4, 4], device),
            group_idx: indices(restype_atom14_to_rigid_group().into_iter().flatten(), &[21, 14], device),
            atom14_mask: floats(restype_atom14_mask().as_flattened(), &[21, 14], device),
            lit_positions: floats(&lit, &[21, 14, 3], device),
            atom14_to_atom37: indices(restype_atom14_to_atom37().into_iter().flatten(), &[21, 14], device),
            atom37_to_atom14: indices(restype_atom37_to_atom14().into_iter().flatten(), &[21, 37], device),
            atom37_mask: floats(restype_atom37_mask().as_flattened(), &[21, 37], device),
            chi_angles_atom_indices: indices(
                chi_angles_atom_indices().into_iter().flatten().flatten(),
                &[21, 4, 4],
                device,
            ),
            chi_angles_mask: floats(CHI_ANGLES_MASK.as_flattened(), &[21, 4], device),
            chi_pi_periodic: floats(CHI_PI_PERIODIC.as_flattened(), &[21, 4], device),
            atom14_is_ambiguous: floats(restype_atom14_is_ambiguous().as_flattened(), &[21, 14], device),
            atom14_renaming: indices(restype_atom14_renaming().into_iter().flatten(), &[21, 14], device),
            rigidgroup_base_atoms: indices(
                restype_rigidgroup_base_atom37_idx().into_iter().flatten().flatten(),
                &[21, 8, 3],
                device,
            ),
            rigidgroup_mask: floats(restype_rigidgroup_mask().as_flattened(), &[21, 8], device),
            rigidgroup_is_ambiguous: floats(restype_rigidgroup_is_ambiguous().as_flattened(), &[21, 8], device),
        }
    }
}

// ---------------------------------------------------------------------------------------
// Literal tables, transcribed from AlphaFold's residue_constants.py. Rows are in `restypes`
// order (ALA ARG ASN ASP CYS GLN GLU GLY HIS ILE LEU LYS MET PHE PRO SER THR TRP TYR VAL),
// which is the alphabetical order of the 3-letter codes.
