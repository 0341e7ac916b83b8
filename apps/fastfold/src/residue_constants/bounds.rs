//! What AlphaFold's structural-violation checks hold a structure to (`residue_constants.py`):
//! the peptide bond between residues, van der Waals radii, and each residue type's bounds on
//! the distance between two of its atoms (`make_atom14_dists_bounds`), from the bond lengths
//! and angles of [`super::stereo_chemistry`] (an angle read as the distance between its outer
//! atoms, `load_stereo_chemical_props`' "virtual bonds"). Computed in f64 as AlphaFold's numpy
//! does, the bounds stored in f32.
use super::stereo_chemistry::{BOND_ANGLES, BOND_LENGTHS};
use super::{RESNAMES, RESTYPE_NAME_TO_ATOM14_NAMES, RESTYPE_NUM};

/// The C-N peptide bond's length (Å), to any residue and to proline
/// (`between_res_bond_length_c_n`).
pub const BETWEEN_RES_BOND_LENGTH_C_N: [f64; 2] = [1.329, 1.341];
/// Its standard deviation (Å), to any residue and to proline.
pub const BETWEEN_RES_BOND_LENGTH_STDDEV_C_N: [f64; 2] = [0.014, 0.016];
/// Cosine of the C-N-CA angle across the peptide bond and its standard deviation (121.352 ±
/// 2.315°).
pub const BETWEEN_RES_COS_ANGLES_C_N_CA: [f64; 2] = [-0.5203, 0.0353];
/// Cosine of the CA-C-N angle across the peptide bond and its standard deviation (116.568 ±
/// 1.995°). AlphaFold's bond loss reads the standard deviation of the C-N bond length
/// ([`BETWEEN_RES_BOND_LENGTH_STDDEV_C_N`]) for this angle in place of this one, and so does
/// `fastfold`.
pub const BETWEEN_RES_COS_ANGLES_CA_C_N: [f64; 2] = [-0.4473, 0.0311];
/// The distance between consecutive Cα atoms in a trans peptide (Å, `ca_ca`).
pub const CA_CA: f64 = 3.80209737096;

/// Van der Waals radius (Å) of an atom by its element, the first letter of its PDB name
/// (`van_der_waals_radius`: C, N, O, S); `None` for any other.
pub fn van_der_waals_radius(atom: &str) -> Option<f64> {
    match atom.chars().next()? {
        'C' => Some(1.7),
        'N' => Some(1.55),
        'O' => Some(1.52),
        'S' => Some(1.8),
        _ => None,
    }
}

/// A distance between two atoms of a residue and its standard deviation (Å).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Bond {
    /// The two atoms' names.
    pub atoms: [&'static str; 2],
    /// The mean distance.
    pub length: f64,
    /// Its standard deviation.
    pub stddev: f64,
}

/// A bond angle and its standard deviation, in radians.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BondAngle {
    /// The three atoms' names, the vertex in the middle.
    pub atoms: [&'static str; 3],
    /// The mean angle.
    pub angle: f64,
    /// Its standard deviation.
    pub stddev: f64,
}

/// The bonds of residue type `restype` (0..20; none for `UNK`), in the table's order.
pub fn bonds(restype: usize) -> Vec<Bond> {
    let rows = BOND_LENGTHS.get(restype).copied().unwrap_or_default();
    rows.iter().map(|&(a, b, length, stddev)| Bond { atoms: [a, b], length, stddev }).collect()
}

/// The bond angles of residue type `restype`, converted to radians as AlphaFold does
/// (`degrees / 180 * π`).
pub fn bond_angles(restype: usize) -> Vec<BondAngle> {
    let radians = |deg: f64| deg / 180.0 * std::f64::consts::PI;
    let rows = BOND_ANGLES.get(restype).copied().unwrap_or_default();
    rows.iter()
        .map(|&(a, b, c, angle, stddev)| BondAngle { atoms: [a, b, c], angle: radians(angle), stddev: radians(stddev) })
        .collect()
}

/// Each bond angle of residue type `restype` as the distance between its outer atoms (the law
/// of cosines on its two bonds) with that distance's standard deviation (the three
/// uncertainties propagated as uncorrelated), in the angles' order.
pub fn virtual_bonds(restype: usize) -> Vec<Bond> {
    let bonds = bonds(restype);
    let find = |x: &str, y: &str| {
        bonds.iter().find(|b| (b.atoms[0] == x && b.atoms[1] == y) || (b.atoms[0] == y && b.atoms[1] == x)).copied()
    };
    bond_angles(restype)
        .into_iter()
        .filter_map(|ba| {
            let [a, v, c] = ba.atoms;
            let (b1, b2) = (find(a, v)?, find(v, c)?);
            let (l1, l2, gamma) = (b1.length, b2.length, ba.angle);
            let length = (l1 * l1 + l2 * l2 - 2.0 * l1 * l2 * gamma.cos()).sqrt();
            let outer = 0.5 / length;
            let dl_dgamma = (2.0 * l1 * l2 * gamma.sin()) * outer;
            let dl_db1 = (2.0 * l1 - 2.0 * l2 * gamma.cos()) * outer;
            let dl_db2 = (2.0 * l2 - 2.0 * l1 * gamma.cos()) * outer;
            let stddev =
                ((dl_dgamma * ba.stddev).powi(2) + (dl_db1 * b1.stddev).powi(2) + (dl_db2 * b2.stddev).powi(2)).sqrt();
            Some(Bond { atoms: [a, c], length, stddev })
        })
        .collect()
}

/// Per residue type and pair of atom14 slots `[21][14][14]`: the lowest and highest distance
/// allowed and, for bonded pairs, the distance's standard deviation.
#[derive(Debug, Clone)]
pub struct Atom14DistsBounds {
    /// Lower bounds (Å).
    pub lower: Vec<[[f32; 14]; 14]>,
    /// Upper bounds (Å; 1e10 for pairs that are not bonded).
    pub upper: Vec<[[f32; 14]; 14]>,
    /// Standard deviations (Å; 0 for pairs that are not bonded).
    pub stddev: Vec<[[f32; 14]; 14]>,
}

/// `make_atom14_dists_bounds`: for every two distinct atoms of a residue type, at least the sum
/// of their van der Waals radii less `overlap_tolerance` (Å) and at most 1e10; for bonds and
/// bond angles (virtual bonds) instead the length within `bond_length_tolerance_factor`
/// standard deviations. `UNK` has no atoms: zeros.
pub fn atom14_dists_bounds(overlap_tolerance: f64, bond_length_tolerance_factor: f64) -> Atom14DistsBounds {
    let zeros = vec![[[0f32; 14]; 14]; RESTYPE_NUM + 1];
    let mut out = Atom14DistsBounds { lower: zeros.clone(), upper: zeros.clone(), stddev: zeros };
    for restype in 0..RESTYPE_NUM {
        let names = &RESTYPE_NAME_TO_ATOM14_NAMES[restype];
        let radius = |k: usize| van_der_waals_radius(names[k]).unwrap_or(0.0);
        let present: Vec<usize> = (0..14).filter(|&k| !names[k].is_empty()).collect();
        for &i in &present {
            for &j in present.iter().filter(|&&j| j != i) {
                out.lower[restype][i][j] = (radius(i) + radius(j) - overlap_tolerance) as f32;
                out.upper[restype][i][j] = 1e10;
            }
        }
        let slot = |name: &str| names.iter().position(|&n| n == name);
        for b in bonds(restype).into_iter().chain(virtual_bonds(restype)) {
            let (Some(i), Some(j)) = (slot(b.atoms[0]), slot(b.atoms[1])) else {
                debug_assert!(false, "{}: {:?} not in its atom14 names", RESNAMES[restype], b.atoms);
                continue;
            };
            let (lower, upper) = (
                b.length - bond_length_tolerance_factor * b.stddev,
                b.length + bond_length_tolerance_factor * b.stddev,
            );
            for (x, y) in [(i, j), (j, i)] {
                out.lower[restype][x][y] = lower as f32;
                out.upper[restype][x][y] = upper as f32;
                out.stddev[restype][x][y] = b.stddev as f32;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::residue_constants::RESIDUE_ATOMS;

    #[test]
    fn every_bond_and_angle_names_atoms_of_its_residue() {
        for restype in 0..RESTYPE_NUM {
            let angles = bond_angles(restype);
            // Every angle's two bonds are in the table, so each becomes a virtual bond.
            assert_eq!(virtual_bonds(restype).len(), angles.len(), "{}", RESNAMES[restype]);
            let atoms = RESIDUE_ATOMS[restype];
            let names =
                bonds(restype).into_iter().flat_map(|b| b.atoms).chain(angles.into_iter().flat_map(|a| a.atoms));
            for name in names {
                assert!(atoms.contains(&name), "{}: {name}", RESNAMES[restype]);
            }
        }
    }

    #[test]
    fn a_bond_angle_is_the_distance_between_its_outer_atoms() {
        // Alanine's N-CA-CB angle: its virtual bond is the law of cosines on N-CA and CA-CB.
        let v = virtual_bonds(0)[0];
        let (a, b, g) = (1.459f64, 1.520f64, 110.1f64.to_radians());
        assert_eq!(v.atoms, ["N", "CB"]);
        assert!((v.length - (a * a + b * b - 2.0 * a * b * g.cos()).sqrt()).abs() < 1e-12);
        let bounds = atom14_dists_bounds(1.5, 12.0);
        // Alanine's N (slot 0) and CB (slot 4): the virtual bond's bounds; N and O (3): radii.
        let (lo, hi) = (bounds.lower[0][0][4] as f64, bounds.upper[0][0][4] as f64);
        assert!((lo - (v.length - 12.0 * v.stddev)).abs() < 1e-6 && (hi - (v.length + 12.0 * v.stddev)).abs() < 1e-6);
        assert!((bounds.lower[0][0][3] as f64 - (1.55 + 1.52 - 1.5)).abs() < 1e-6);
        assert_eq!(bounds.upper[0][0][3], 1e10);
        assert_eq!(bounds.lower[20], [[0.0; 14]; 14], "UNK");
    }
}
