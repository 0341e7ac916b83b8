//! AlphaFold's residue and atom tables (`alphafold/common/residue_constants.py`), as data.
//!
//! Residue types are indexed in AlphaFold's `restypes` order (the 3-letter codes sorted
//! alphabetically, `ARNDCQEGHILKMFPSTWYV`), with 20 = `X`/`UNK` and, in MSAs, 21 = gap and
//! 22 = the masked-MSA token. Atoms come in two layouts: atom37 (one slot for every heavy-atom
//! name any residue has, [`ATOM_TYPES`]) and atom14 (a residue's own atoms packed into 14
//! slots, [`RESTYPE_NAME_TO_ATOM14_NAMES`]). The literal tables below are transcribed from
//! AlphaFold; the index tables and the rigid-group frames are computed from them here the way
//! AlphaFold computes them, so there is a single source for each fact. [`Tables::new`] puts
//! what the model needs on a device as tensors.
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
        }
    }
}

// ---------------------------------------------------------------------------------------
// Literal tables, transcribed from AlphaFold's residue_constants.py. Rows are in `restypes`
// order (ALA ARG ASN ASP CYS GLN GLU GLY HIS ILE LEU LYS MET PHE PRO SER THR TRP TYR VAL),
// which is the alphabetical order of the 3-letter codes.

/// Heavy atoms of each residue type (`residue_atoms`, PDB names).
pub const RESIDUE_ATOMS: [&[&str]; 20] = [
    &["C", "CA", "CB", "N", "O"],                                         // ALA
    &["C", "CA", "CB", "CG", "CD", "CZ", "N", "NE", "O", "NH1", "NH2"],   // ARG
    &["C", "CA", "CB", "CG", "N", "ND2", "O", "OD1"],                     // ASN
    &["C", "CA", "CB", "CG", "N", "O", "OD1", "OD2"],                     // ASP
    &["C", "CA", "CB", "N", "O", "SG"],                                   // CYS
    &["C", "CA", "CB", "CG", "CD", "N", "NE2", "O", "OE1"],               // GLN
    &["C", "CA", "CB", "CG", "CD", "N", "O", "OE1", "OE2"],               // GLU
    &["C", "CA", "N", "O"],                                               // GLY
    &["C", "CA", "CB", "CG", "CD2", "CE1", "N", "ND1", "NE2", "O"],       // HIS
    &["C", "CA", "CB", "CG1", "CG2", "CD1", "N", "O"],                    // ILE
    &["C", "CA", "CB", "CG", "CD1", "CD2", "N", "O"],                     // LEU
    &["C", "CA", "CB", "CG", "CD", "CE", "N", "NZ", "O"],                 // LYS
    &["C", "CA", "CB", "CG", "CE", "N", "O", "SD"],                       // MET
    &["C", "CA", "CB", "CG", "CD1", "CD2", "CE1", "CE2", "CZ", "N", "O"], // PHE
    &["C", "CA", "CB", "CG", "CD", "N", "O"],                             // PRO
    &["C", "CA", "CB", "N", "O", "OG"],                                   // SER
    &["C", "CA", "CB", "CG2", "N", "O", "OG1"],                           // THR
    &["C", "CA", "CB", "CG", "CD1", "CD2", "CE2", "CE3", "CZ2", "CZ3", "CH2", "N", "NE1", "O"], // TRP
    &["C", "CA", "CB", "CG", "CD1", "CD2", "CE1", "CE2", "CZ", "N", "O", "OH"], // TYR
    &["C", "CA", "CB", "CG1", "CG2", "N", "O"],                           // VAL
];

/// Atom14 slot names per residue type (`restype_name_to_atom14_names`); `""` is an empty slot.
pub const RESTYPE_NAME_TO_ATOM14_NAMES: [[&str; 14]; 21] = [
    ["N", "CA", "C", "O", "CB", "", "", "", "", "", "", "", "", ""], // ALA
    ["N", "CA", "C", "O", "CB", "CG", "CD", "NE", "CZ", "NH1", "NH2", "", "", ""], // ARG
    ["N", "CA", "C", "O", "CB", "CG", "OD1", "ND2", "", "", "", "", "", ""], // ASN
    ["N", "CA", "C", "O", "CB", "CG", "OD1", "OD2", "", "", "", "", "", ""], // ASP
    ["N", "CA", "C", "O", "CB", "SG", "", "", "", "", "", "", "", ""], // CYS
    ["N", "CA", "C", "O", "CB", "CG", "CD", "OE1", "NE2", "", "", "", "", ""], // GLN
    ["N", "CA", "C", "O", "CB", "CG", "CD", "OE1", "OE2", "", "", "", "", ""], // GLU
    ["N", "CA", "C", "O", "", "", "", "", "", "", "", "", "", ""],   // GLY
    ["N", "CA", "C", "O", "CB", "CG", "ND1", "CD2", "CE1", "NE2", "", "", "", ""], // HIS
    ["N", "CA", "C", "O", "CB", "CG1", "CG2", "CD1", "", "", "", "", "", ""], // ILE
    ["N", "CA", "C", "O", "CB", "CG", "CD1", "CD2", "", "", "", "", "", ""], // LEU
    ["N", "CA", "C", "O", "CB", "CG", "CD", "CE", "NZ", "", "", "", "", ""], // LYS
    ["N", "CA", "C", "O", "CB", "CG", "SD", "CE", "", "", "", "", "", ""], // MET
    ["N", "CA", "C", "O", "CB", "CG", "CD1", "CD2", "CE1", "CE2", "CZ", "", "", ""], // PHE
    ["N", "CA", "C", "O", "CB", "CG", "CD", "", "", "", "", "", "", ""], // PRO
    ["N", "CA", "C", "O", "CB", "OG", "", "", "", "", "", "", "", ""], // SER
    ["N", "CA", "C", "O", "CB", "OG1", "CG2", "", "", "", "", "", "", ""], // THR
    ["N", "CA", "C", "O", "CB", "CG", "CD1", "CD2", "NE1", "CE2", "CE3", "CZ2", "CZ3", "CH2"], // TRP
    ["N", "CA", "C", "O", "CB", "CG", "CD1", "CD2", "CE1", "CE2", "CZ", "OH", "", ""], // TYR
    ["N", "CA", "C", "O", "CB", "CG1", "CG2", "", "", "", "", "", "", ""], // VAL
    ["", "", "", "", "", "", "", "", "", "", "", "", "", ""],        // UNK
];

/// The four atoms defining each chi angle (chi1 first; ARG's chi5 is left out as in AlphaFold).
pub const CHI_ANGLES_ATOMS: [&[[&str; 4]]; 20] = [
    &[],                                                                                                      // ALA
    &[["N", "CA", "CB", "CG"], ["CA", "CB", "CG", "CD"], ["CB", "CG", "CD", "NE"], ["CG", "CD", "NE", "CZ"]], // ARG
    &[["N", "CA", "CB", "CG"], ["CA", "CB", "CG", "OD1"]],                                                    // ASN
    &[["N", "CA", "CB", "CG"], ["CA", "CB", "CG", "OD1"]],                                                    // ASP
    &[["N", "CA", "CB", "SG"]],                                                                               // CYS
    &[["N", "CA", "CB", "CG"], ["CA", "CB", "CG", "CD"], ["CB", "CG", "CD", "OE1"]],                          // GLN
    &[["N", "CA", "CB", "CG"], ["CA", "CB", "CG", "CD"], ["CB", "CG", "CD", "OE1"]],                          // GLU
    &[],                                                                                                      // GLY
    &[["N", "CA", "CB", "CG"], ["CA", "CB", "CG", "ND1"]],                                                    // HIS
    &[["N", "CA", "CB", "CG1"], ["CA", "CB", "CG1", "CD1"]],                                                  // ILE
    &[["N", "CA", "CB", "CG"], ["CA", "CB", "CG", "CD1"]],                                                    // LEU
    &[["N", "CA", "CB", "CG"], ["CA", "CB", "CG", "CD"], ["CB", "CG", "CD", "CE"], ["CG", "CD", "CE", "NZ"]], // LYS
    &[["N", "CA", "CB", "CG"], ["CA", "CB", "CG", "SD"], ["CB", "CG", "SD", "CE"]],                           // MET
    &[["N", "CA", "CB", "CG"], ["CA", "CB", "CG", "CD1"]],                                                    // PHE
    &[["N", "CA", "CB", "CG"], ["CA", "CB", "CG", "CD"]],                                                     // PRO
    &[["N", "CA", "CB", "OG"]],                                                                               // SER
    &[["N", "CA", "CB", "OG1"]],                                                                              // THR
    &[["N", "CA", "CB", "CG"], ["CA", "CB", "CG", "CD1"]],                                                    // TRP
    &[["N", "CA", "CB", "CG"], ["CA", "CB", "CG", "CD1"]],                                                    // TYR
    &[["N", "CA", "CB", "CG1"]],                                                                              // VAL
];

/// Which of chi1..chi4 each residue type has (`chi_angles_mask`, with a zero row for `UNK`).
pub const CHI_ANGLES_MASK: [[f32; 4]; 21] = [
    [0.0, 0.0, 0.0, 0.0], // ALA
    [1.0, 1.0, 1.0, 1.0], // ARG
    [1.0, 1.0, 0.0, 0.0], // ASN
    [1.0, 1.0, 0.0, 0.0], // ASP
    [1.0, 0.0, 0.0, 0.0], // CYS
    [1.0, 1.0, 1.0, 0.0], // GLN
    [1.0, 1.0, 1.0, 0.0], // GLU
    [0.0, 0.0, 0.0, 0.0], // GLY
    [1.0, 1.0, 0.0, 0.0], // HIS
    [1.0, 1.0, 0.0, 0.0], // ILE
    [1.0, 1.0, 0.0, 0.0], // LEU
    [1.0, 1.0, 1.0, 1.0], // LYS
    [1.0, 1.0, 1.0, 0.0], // MET
    [1.0, 1.0, 0.0, 0.0], // PHE
    [1.0, 1.0, 0.0, 0.0], // PRO
    [1.0, 0.0, 0.0, 0.0], // SER
    [1.0, 0.0, 0.0, 0.0], // THR
    [1.0, 1.0, 0.0, 0.0], // TRP
    [1.0, 1.0, 0.0, 0.0], // TYR
    [1.0, 0.0, 0.0, 0.0], // VAL
    [0.0, 0.0, 0.0, 0.0], // UNK
];

/// Chi angles that are pi-periodic (symmetric side chains), `chi_pi_periodic`.
pub const CHI_PI_PERIODIC: [[f32; 4]; 21] = [
    [0.0, 0.0, 0.0, 0.0], // ALA
    [0.0, 0.0, 0.0, 0.0], // ARG
    [0.0, 0.0, 0.0, 0.0], // ASN
    [0.0, 1.0, 0.0, 0.0], // ASP
    [0.0, 0.0, 0.0, 0.0], // CYS
    [0.0, 0.0, 0.0, 0.0], // GLN
    [0.0, 0.0, 1.0, 0.0], // GLU
    [0.0, 0.0, 0.0, 0.0], // GLY
    [0.0, 0.0, 0.0, 0.0], // HIS
    [0.0, 0.0, 0.0, 0.0], // ILE
    [0.0, 0.0, 0.0, 0.0], // LEU
    [0.0, 0.0, 0.0, 0.0], // LYS
    [0.0, 0.0, 0.0, 0.0], // MET
    [0.0, 1.0, 0.0, 0.0], // PHE
    [0.0, 0.0, 0.0, 0.0], // PRO
    [0.0, 0.0, 0.0, 0.0], // SER
    [0.0, 0.0, 0.0, 0.0], // THR
    [0.0, 0.0, 0.0, 0.0], // TRP
    [0.0, 1.0, 0.0, 0.0], // TYR
    [0.0, 0.0, 0.0, 0.0], // VAL
    [0.0, 0.0, 0.0, 0.0], // UNK
];

/// `rigid_group_atom_positions`: each atom's rigid group (0 backbone, 3 psi, 4..=7 chi1..chi4)
/// and ideal position in that group's frame (Angstrom). The x axis runs along the group's
/// rotation axis and the atom that defines the torsion lies in the xy plane with y > 0.
pub const RIGID_GROUP_ATOM_POSITIONS: [&[(&str, usize, [f64; 3])]; 20] = [
    // ALA
    &[
        ("N", 0, [-0.525, 1.363, 0.000]),
        ("CA", 0, [0.000, 0.000, 0.000]),
        ("C", 0, [1.526, -0.0, -0.0]),
        ("CB", 0, [-0.529, -0.774, -1.205]),
        ("O", 3, [0.627, 1.062, 0.000]),
    ],
    // ARG
    &[
        ("N", 0, [-0.524, 1.362, -0.0]),
        ("CA", 0, [0.000, 0.000, 0.000]),
        ("C", 0, [1.525, -0.0, -0.0]),
        ("CB", 0, [-0.524, -0.778, -1.209]),
        ("O", 3, [0.626, 1.062, 0.000]),
        ("CG", 4, [0.616, 1.390, -0.0]),
        ("CD", 5, [0.564, 1.414, 0.000]),
        ("NE", 6, [0.539, 1.357, -0.0]),
        ("NH1", 7, [0.206, 2.301, 0.000]),
        ("NH2", 7, [2.078, 0.978, -0.0]),
        ("CZ", 7, [0.758, 1.093, -0.0]),
    ],
    // ASN
    &[
        ("N", 0, [-0.536, 1.357, 0.000]),
        ("CA", 0, [0.000, 0.000, 0.000]),
        ("C", 0, [1.526, -0.0, -0.0]),
        ("CB", 0, [-0.531, -0.787, -1.200]),
        ("O", 3, [0.625, 1.062, 0.000]),
        ("CG", 4, [0.584, 1.399, 0.000]),
        ("ND2", 5, [0.593, -1.188, 0.001]),
        ("OD1", 5, [0.633, 1.059, 0.000]),
    ],
    // ASP
    &[
        ("N", 0, [-0.525, 1.362, -0.0]),
        ("CA", 0, [0.000, 0.000, 0.000]),
        ("C", 0, [1.527, 0.000, -0.0]),
        ("CB", 0, [-0.526, -0.778, -1.208]),
        ("O", 3, [0.626, 1.062, -0.0]),
        ("CG", 4, [0.593, 1.398, -0.0]),
        ("OD1", 5, [0.610, 1.091, 0.000]),
        ("OD2", 5, [0.592, -1.101, -0.003]),
    ],
    // CYS
    &[
        ("N", 0, [-0.522, 1.362, -0.0]),
        ("CA", 0, [0.000, 0.000, 0.000]),
        ("C", 0, [1.524, 0.000, 0.000]),
        ("CB", 0, [-0.519, -0.773, -1.212]),
        ("O", 3, [0.625, 1.062, -0.0]),
        ("SG", 4, [0.728, 1.653, 0.000]),
    ],
    // GLN
    &[
        ("N", 0, [-0.526, 1.361, -0.0]),
        ("CA", 0, [0.000, 0.000, 0.000]),
        ("C", 0, [1.526, 0.000, 0.000]),
        ("CB", 0, [-0.525, -0.779, -1.207]),
        ("O", 3, [0.626, 1.062, -0.0]),
        ("CG", 4, [0.615, 1.393, 0.000]),
        ("CD", 5, [0.587, 1.399, -0.0]),
        ("NE2", 6, [0.593, -1.189, -0.001]),
        ("OE1", 6, [0.634, 1.060, 0.000]),
    ],
    // GLU
    &[
        ("N", 0, [-0.528, 1.361, 0.000]),
        ("CA", 0, [0.000, 0.000, 0.000]),
        ("C", 0, [1.526, -0.0, -0.0]),
        ("CB", 0, [-0.526, -0.781, -1.207]),
        ("O", 3, [0.626, 1.062, 0.000]),
        ("CG", 4, [0.615, 1.392, 0.000]),
        ("CD", 5, [0.600, 1.397, 0.000]),
        ("OE1", 6, [0.607, 1.095, -0.0]),
        ("OE2", 6, [0.589, -1.104, -0.001]),
    ],
    // GLY
    &[
        ("N", 0, [-0.572, 1.337, 0.000]),
        ("CA", 0, [0.000, 0.000, 0.000]),
        ("C", 0, [1.517, -0.0, -0.0]),
        ("O", 3, [0.626, 1.062, -0.0]),
    ],
    // HIS
    &[
        ("N", 0, [-0.527, 1.360, 0.000]),
        ("CA", 0, [0.000, 0.000, 0.000]),
        ("C", 0, [1.525, 0.000, 0.000]),
        ("CB", 0, [-0.525, -0.778, -1.208]),
        ("O", 3, [0.625, 1.063, 0.000]),
        ("CG", 4, [0.600, 1.370, -0.0]),
        ("CD2", 5, [0.889, -1.021, 0.003]),
        ("ND1", 5, [0.744, 1.160, -0.0]),
        ("CE1", 5, [2.030, 0.851, 0.002]),
        ("NE2", 5, [2.145, -0.466, 0.004]),
    ],
    // ILE
    &[
        ("N", 0, [-0.493, 1.373, -0.0]),
        ("CA", 0, [0.000, 0.000, 0.000]),
        ("C", 0, [1.527, -0.0, -0.0]),
        ("CB", 0, [-0.536, -0.793, -1.213]),
        ("O", 3, [0.627, 1.062, -0.0]),
        ("CG1", 4, [0.534, 1.437, -0.0]),
        ("CG2", 4, [0.540, -0.785, -1.199]),
        ("CD1", 5, [0.619, 1.391, 0.000]),
    ],
    // LEU
    &[
        ("N", 0, [-0.520, 1.363, 0.000]),
        ("CA", 0, [0.000, 0.000, 0.000]),
        ("C", 0, [1.525, -0.0, -0.0]),
        ("CB", 0, [-0.522, -0.773, -1.214]),
        ("O", 3, [0.625, 1.063, -0.0]),
        ("CG", 4, [0.678, 1.371, 0.000]),
        ("CD1", 5, [0.530, 1.430, -0.0]),
        ("CD2", 5, [0.535, -0.774, 1.200]),
    ],
    // LYS
    &[
        ("N", 0, [-0.526, 1.362, -0.0]),
        ("CA", 0, [0.000, 0.000, 0.000]),
        ("C", 0, [1.526, 0.000, 0.000]),
        ("CB", 0, [-0.524, -0.778, -1.208]),
        ("O", 3, [0.626, 1.062, -0.0]),
        ("CG", 4, [0.619, 1.390, 0.000]),
        ("CD", 5, [0.559, 1.417, 0.000]),
        ("CE", 6, [0.560, 1.416, 0.000]),
        ("NZ", 7, [0.554, 1.387, 0.000]),
    ],
    // MET
    &[
        ("N", 0, [-0.521, 1.364, -0.0]),
        ("CA", 0, [0.000, 0.000, 0.000]),
        ("C", 0, [1.525, 0.000, 0.000]),
        ("CB", 0, [-0.523, -0.776, -1.210]),
        ("O", 3, [0.625, 1.062, -0.0]),
        ("CG", 4, [0.613, 1.391, -0.0]),
        ("SD", 5, [0.703, 1.695, 0.000]),
        ("CE", 6, [0.320, 1.786, -0.0]),
    ],
    // PHE
    &[
        ("N", 0, [-0.518, 1.363, 0.000]),
        ("CA", 0, [0.000, 0.000, 0.000]),
        ("C", 0, [1.524, 0.000, -0.0]),
        ("CB", 0, [-0.525, -0.776, -1.212]),
        ("O", 3, [0.626, 1.062, -0.0]),
        ("CG", 4, [0.607, 1.377, 0.000]),
        ("CD1", 5, [0.709, 1.195, -0.0]),
        ("CD2", 5, [0.706, -1.196, 0.000]),
        ("CE1", 5, [2.102, 1.198, -0.0]),
        ("CE2", 5, [2.098, -1.201, -0.0]),
        ("CZ", 5, [2.794, -0.003, -0.001]),
    ],
    // PRO
    &[
        ("N", 0, [-0.566, 1.351, -0.0]),
        ("CA", 0, [0.000, 0.000, 0.000]),
        ("C", 0, [1.527, -0.0, 0.000]),
        ("CB", 0, [-0.546, -0.611, -1.293]),
        ("O", 3, [0.621, 1.066, 0.000]),
        ("CG", 4, [0.382, 1.445, 0.000]),
        ("CD", 5, [0.477, 1.424, 0.000]),
    ],
    // SER
    &[
        ("N", 0, [-0.529, 1.360, -0.0]),
        ("CA", 0, [0.000, 0.000, 0.000]),
        ("C", 0, [1.525, -0.0, -0.0]),
        ("CB", 0, [-0.518, -0.777, -1.211]),
        ("O", 3, [0.626, 1.062, -0.0]),
        ("OG", 4, [0.503, 1.325, 0.000]),
    ],
    // THR
    &[
        ("N", 0, [-0.517, 1.364, 0.000]),
        ("CA", 0, [0.000, 0.000, 0.000]),
        ("C", 0, [1.526, 0.000, -0.0]),
        ("CB", 0, [-0.516, -0.793, -1.215]),
        ("O", 3, [0.626, 1.062, 0.000]),
        ("CG2", 4, [0.550, -0.718, -1.228]),
        ("OG1", 4, [0.472, 1.353, 0.000]),
    ],
    // TRP
    &[
        ("N", 0, [-0.521, 1.363, 0.000]),
        ("CA", 0, [0.000, 0.000, 0.000]),
        ("C", 0, [1.525, -0.0, 0.000]),
        ("CB", 0, [-0.523, -0.776, -1.212]),
        ("O", 3, [0.627, 1.062, 0.000]),
        ("CG", 4, [0.609, 1.370, -0.0]),
        ("CD1", 5, [0.824, 1.091, 0.000]),
        ("CD2", 5, [0.854, -1.148, -0.005]),
        ("CE2", 5, [2.186, -0.678, -0.007]),
        ("CE3", 5, [0.622, -2.530, -0.007]),
        ("NE1", 5, [2.140, 0.690, -0.004]),
        ("CH2", 5, [3.028, -2.890, -0.013]),
        ("CZ2", 5, [3.283, -1.543, -0.011]),
        ("CZ3", 5, [1.715, -3.389, -0.011]),
    ],
    // TYR
    &[
        ("N", 0, [-0.522, 1.362, 0.000]),
        ("CA", 0, [0.000, 0.000, 0.000]),
        ("C", 0, [1.524, -0.0, -0.0]),
        ("CB", 0, [-0.522, -0.776, -1.213]),
        ("O", 3, [0.627, 1.062, -0.0]),
        ("CG", 4, [0.607, 1.382, -0.0]),
        ("CD1", 5, [0.716, 1.195, -0.0]),
        ("CD2", 5, [0.713, -1.194, -0.001]),
        ("CE1", 5, [2.107, 1.200, -0.002]),
        ("CE2", 5, [2.104, -1.201, -0.003]),
        ("OH", 5, [4.168, -0.002, -0.005]),
        ("CZ", 5, [2.791, -0.001, -0.003]),
    ],
    // VAL
    &[
        ("N", 0, [-0.494, 1.373, -0.0]),
        ("CA", 0, [0.000, 0.000, 0.000]),
        ("C", 0, [1.527, -0.0, -0.0]),
        ("CB", 0, [-0.533, -0.795, -1.213]),
        ("O", 3, [0.627, 1.062, -0.0]),
        ("CG1", 4, [0.540, 1.429, -0.0]),
        ("CG2", 4, [0.533, -0.776, 1.203]),
    ],
];
