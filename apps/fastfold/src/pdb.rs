//! PDB output of a predicted structure (one model, chain A or a complex's chains, fixed-column
//! `ATOM` records), and
//! input of a target structure for training ([`Structure::parse`]).
//!
//! The layout follows the wwPDB v3.3 `ATOM` record (and AlphaFold's `protein.to_pdb`): serial
//! in columns 7-11, the atom name in 13-16 (a name shorter than four characters starts in
//! column 14, so the element symbol lines up in 13-14), residue name 18-20, chain 22, residue
//! number 23-26, coordinates 31-54 as `8.3f`, occupancy 55-60, B-factor 61-66 (the residue's
//! pLDDT), element 77-78. Every line is padded to 80 characters. Atoms whose mask is below 0.5
//! are left out. The file is written through a temporary file and renamed into place.
use std::io::Write;
use std::path::Path;

use data::{Error, Result};
use tch::{Kind, Tensor};

use crate::residue_constants::{
    amino_acid_aatype, residue_atom_order, ATOM_TYPES, ATOM_TYPE_NUM, RESNAMES, UNK_RESTYPE_INDEX,
};

/// A predicted structure in the atom37 layout, on the CPU.
#[derive(Clone, Debug, PartialEq)]
pub struct Structure {
    /// Residue types `[N]` (0..=20, `restypes` order).
    pub aatype: Vec<usize>,
    /// 0-based residue indices `[N]` (the `residue_index` feature); written as index + 1.
    pub residue_index: Vec<i64>,
    /// Atom positions `[N][37]` in Angstrom.
    pub positions: Vec<[[f32; 3]; ATOM_TYPE_NUM]>,
    /// Atom mask `[N][37]`; atoms below 0.5 are not written.
    pub mask: Vec<[f32; ATOM_TYPE_NUM]>,
    /// Per-residue B-factors `[N]` (pLDDT, 0-100).
    pub b_factors: Vec<f32>,
}

fn tensor_err(what: &str) -> impl Fn(tch::TchError) -> Error + '_ {
    move |e| Error::Format { path: "<tensors>".into(), msg: format!("{what}: {e}") }
}

fn expect_shape(t: &Tensor, what: &str, want: &[i64]) -> Result<()> {
    if t.size() != want {
        return Err(Error::Format {
            path: "<tensors>".into(),
            msg: format!("{what} has shape {:?}, expected {want:?}", t.size()),
        });
    }
    Ok(())
}

impl Structure {
    /// Copies tensors (any device) into a structure: `aatype` `[N]`, `residue_index` `[N]`,
    /// `positions` [N, 37, 3], `mask` [N, 37], `b_factors` `[N]`.
    pub fn from_tensors(
        aatype: &Tensor,
        residue_index: &Tensor,
        positions: &Tensor,
        mask: &Tensor,
        b_factors: &Tensor,
    ) -> Result<Structure> {
        let n = aatype.size().first().copied().unwrap_or(0);
        expect_shape(aatype, "aatype", &[n])?;
        expect_shape(residue_index, "residue_index", &[n])?;
        expect_shape(positions, "atom positions", &[n, ATOM_TYPE_NUM as i64, 3])?;
        expect_shape(mask, "atom mask", &[n, ATOM_TYPE_NUM as i64])?;
        expect_shape(b_factors, "b_factors", &[n])?;
        let longs = |t: &Tensor, what: &str| -> Result<Vec<i64>> {
            Vec::<i64>::try_from(t.f_to_kind(Kind::Int64).map_err(tensor_err(what))?.to_device(tch::Device::Cpu))
                .map_err(tensor_err(what))
        };
        let floats = |t: &Tensor, what: &str| -> Result<Vec<f32>> {
            let t = t.f_to_kind(Kind::Float).map_err(tensor_err(what))?.to_device(tch::Device::Cpu);
            Vec::<f32>::try_from(t.flatten(0, -1)).map_err(tensor_err(what))
        };
        let aatype = longs(aatype, "aatype")?;
        let aatype = aatype
            .iter()
            .map(|&a| usize::try_from(a).ok().filter(|&a| a < RESNAMES.len()))
            .collect::<Option<Vec<usize>>>()
            .ok_or_else(|| Error::Format { path: "<tensors>".into(), msg: "aatype outside 0..=20".into() })?;
        let pos = floats(positions, "atom positions")?;
        let m = floats(mask, "atom mask")?;
        Ok(Structure {
            aatype,
            residue_index: longs(residue_index, "residue_index")?,
            positions: pos
                .chunks_exact(ATOM_TYPE_NUM * 3)
                .map(|r| std::array::from_fn(|a| [r[3 * a], r[3 * a + 1], r[3 * a + 2]]))
                .collect(),
            mask: m.chunks_exact(ATOM_TYPE_NUM).map(|r| std::array::from_fn(|a| r[a])).collect(),
            b_factors: floats(b_factors, "b_factors")?,
        })
    }

    /// The PDB text, every residue in chain A; an error if a field does not fit its columns.
    pub fn to_pdb(&self) -> std::result::Result<String, String> {
        self.to_pdb_with_chains(&vec!['A'; self.aatype.len()])
    }

    /// The PDB text with each residue in the chain `chains[i]` (a complex's chains in order:
    /// a `TER` record ends each, taking a serial number, as AlphaFold's `protein.to_pdb`
    /// writes them); an error if a field does not fit its columns.
    pub fn to_pdb_with_chains(&self, chains: &[char]) -> std::result::Result<String, String> {
        let n = self.aatype.len();
        if [self.residue_index.len(), self.positions.len(), self.mask.len(), self.b_factors.len(), chains.len()]
            != [n; 5]
        {
            return Err("aatype, residue_index, positions, mask, b_factors and chains differ in length".into());
        }
        let mut lines = vec!["MODEL        1".to_string()];
        let mut serial = 1usize;
        let ter = |serial: usize, i: usize| {
            format!(
                "{:<6}{serial:>5}      {:>3} {:1}{:>4}",
                "TER",
                RESNAMES[self.aatype[i]],
                chains[i],
                self.residue_index[i] + 1
            )
        };
        for i in 0..n {
            if i > 0 && chains[i] != chains[i - 1] {
                lines.push(ter(serial, i - 1));
                serial += 1;
            }
            let resname = RESNAMES.get(self.aatype[i]).ok_or_else(|| format!("residue {i}: aatype outside 0..=20"))?;
            let res_seq = self.residue_index[i] + 1;
            if !(-999..=9999).contains(&res_seq) {
                return Err(format!("residue {i}: residue number {res_seq} does not fit columns 23-26"));
            }
            for (a, name) in ATOM_TYPES.iter().enumerate() {
                if self.mask[i][a] < 0.5 {
                    continue;
                }
                let [x, y, z] = self.positions[i][a];
                let coords = format!("{x:>8.3}{y:>8.3}{z:>8.3}");
                if coords.len() != 24 || ![x, y, z].iter().all(|v| v.is_finite()) {
                    return Err(format!("residue {i} atom {name}: coordinates {x} {y} {z} do not fit 8.3f"));
                }
                let b = self.b_factors[i];
                let b_text = format!("{b:>6.2}");
                if b_text.len() != 6 || !b.is_finite() {
                    return Err(format!("residue {i}: B-factor {b} does not fit 6.2f"));
                }
                if serial > 99999 {
                    return Err("more than 99999 atoms".into());
                }
                let padded_name = if name.len() == 4 { name.to_string() } else { format!(" {name}") };
                let element = &name[..1];
                lines.push(format!(
                    "{:<6}{serial:>5} {padded_name:<4}{:1}{resname:>3} {:1}{res_seq:>4}{:1}   {coords}{:>6.2}{b_text}          {element:>2}{:2}",
                    "ATOM", "", chains[i], "", 1.0f32, ""
                ));
                serial += 1;
            }
        }
        if n > 0 {
            lines.push(ter(serial, n - 1));
        }
        lines.push("ENDMDL".into());
        lines.push("END".into());
        let mut text = String::new();
        for line in lines {
            text.push_str(&format!("{line:<80}\n"));
        }
        Ok(text)
    }

    /// Reads the polymer residues of the first model and of one chain (`chain`, or the first
    /// chain met) from PDB text, as AlphaFold's training data reads a chain's residues from
    /// mmCIF: residues in file order up to the chain's `TER`; `ATOM` records are residues,
    /// residue names outside the 20 read as unknown (`X`); of the `HETATM` groups only amino
    /// acids (the 20 standard names; selenomethionine, MSE, read as MET with its SE as SD;
    /// modified ones with a backbone, such as SEP, as X) are residues, and ligands, ions and
    /// waters are not (see `Structure::drop_non_polymer`); atoms matched by name (others, such as hydrogens,
    /// skipped), residues without any known atom skipped, and of alternative locations the
    /// most occupied (see `keeps_new_location`). B-factors are the file's (per residue, from
    /// its CA or first atom). `source` names the text in errors, with the line number.
    pub fn parse(text: &str, source: &Path, chain: Option<char>) -> Result<Structure> {
        let bad =
            |line: usize, msg: String| Error::Format { path: source.to_path_buf(), msg: format!("line {line}: {msg}") };
        let mut s = Structure {
            aatype: Vec::new(),
            residue_index: Vec::new(),
            positions: Vec::new(),
            mask: Vec::new(),
            b_factors: Vec::new(),
        };
        // The kept location's occupancy of each atom, per residue.
        let mut occupancy: Vec<[f32; ATOM_TYPE_NUM]> = Vec::new();
        let mut chain = chain;
        let mut current: Option<(bool, i64, char)> = None;
        // Per residue: read from HETATM records; and whether the chain's TER has passed.
        let (mut heteros, mut ended) = (Vec::new(), false);
        for (i, line) in text.lines().enumerate() {
            let no = i + 1;
            if line.starts_with("ENDMDL") {
                break;
            }
            let hetero = line.starts_with("HETATM");
            let field = |a: usize, b: usize| line.get(a..b.min(line.len())).unwrap_or("").trim();
            let char_at = |a: usize| line.get(a..a + 1).and_then(|c| c.chars().next()).unwrap_or(' ');
            let resname = field(17, 20);
            if line.starts_with("TER") {
                // The chain's polymer ends here: what the file lists under it afterwards
                // (ligands, a free amino acid, waters) is not one of its residues.
                let ter_chain = char_at(21);
                ended |= chain.is_some_and(|c| c == ter_chain || ter_chain == ' ');
                continue;
            }
            if !(hetero || line.starts_with("ATOM  ")) {
                continue;
            }
            if line.len() < 54 {
                // A HETATM record without coordinates is a group's that is not read (a ligand's).
                if hetero {
                    continue;
                }
                return Err(bad(no, format!("ATOM record of {} characters, coordinates need 54", line.len())));
            }
            let this_chain = char_at(21);
            if *chain.get_or_insert(this_chain) != this_chain || ended {
                continue;
            }
            let res_seq: i64 = field(22, 26)
                .parse()
                .map_err(|_| bad(no, format!("residue number {:?} is not an integer", field(22, 26))))?;
            let icode = char_at(26);
            if current != Some((hetero, res_seq, icode)) {
                current = Some((hetero, res_seq, icode));
                heteros.push(hetero);
                s.aatype.push(amino_acid_aatype(resname).unwrap_or(UNK_RESTYPE_INDEX));
                s.residue_index.push(res_seq - 1);
                s.positions.push([[0.0; 3]; ATOM_TYPE_NUM]);
                s.mask.push([0.0; ATOM_TYPE_NUM]);
                s.b_factors.push(field(60, 66).parse().unwrap_or(0.0));
                occupancy.push([0.0; ATOM_TYPE_NUM]);
            }
            let Some(atom) = residue_atom_order(resname, field(12, 16)) else { continue };
            let mut xyz = [0f32; 3];
            for (k, (a, b)) in [(30, 38), (38, 46), (46, 54)].into_iter().enumerate() {
                xyz[k] = field(a, b)
                    .parse::<f32>()
                    .ok()
                    .filter(|x| x.is_finite())
                    .ok_or_else(|| bad(no, format!("coordinate {:?} is not a finite number", field(a, b))))?;
            }
            let occ = field(54, 60).parse::<f32>().unwrap_or(1.0);
            let r = s.aatype.len() - 1;
            let altloc = char_at(16) != ' ';
            if s.mask[r][atom] == 0.0 || keeps_new_location(occupancy[r][atom], occ, altloc) {
                s.positions[r][atom] = xyz;
                s.mask[r][atom] = 1.0;
                occupancy[r][atom] = occ;
                if field(12, 16) == "CA" {
                    s.b_factors[r] = field(60, 66).parse().unwrap_or(s.b_factors[r]);
                }
            }
        }
        s.drop_non_polymer(&heteros);
        s.drop_residues_without_atoms();
        if s.aatype.is_empty() {
            let which = chain.map(|c| format!(" of chain {c:?}")).unwrap_or_default();
            return Err(Error::Format { path: source.to_path_buf(), msg: format!("no ATOM records{which}") });
        }
        Ok(s)
    }

    /// Drops the HETATM groups that are not amino acids of the chain: AlphaFold trains on an
    /// mmCIF chain's polymer residues, and in a PDB file the other groups listed under the
    /// chain are HETATM records, such as ligands (ACT), ions (calcium, whose one atom is named
    /// CA) and waters, each of which would become an X residue of its atoms with atom37 names.
    /// A HETATM group stays when it is an amino acid by name (MSE) or a modified one (SEP, TPO,
    /// MLY, a D-amino acid: X, as AlphaFold's `from_pdb_string` reads them), which is to say
    /// when it has the backbone N, CA and C a polymer residue has.
    fn drop_non_polymer(&mut self, heteros: &[bool]) {
        let backbone = ["N", "CA", "C"].map(|a| ATOM_TYPES.iter().position(|t| *t == a).expect("atom37 backbone"));
        let keep: Vec<bool> = (0..self.aatype.len())
            .map(|r| {
                !heteros[r] || self.aatype[r] != UNK_RESTYPE_INDEX || backbone.iter().all(|&a| self.mask[r][a] > 0.5)
            })
            .collect();
        self.retain(&keep);
    }

    /// Keeps the residues where `keep` is true, in every per-residue field.
    fn retain(&mut self, keep: &[bool]) {
        retain_where(&mut self.aatype, keep);
        retain_where(&mut self.residue_index, keep);
        retain_where(&mut self.positions, keep);
        retain_where(&mut self.mask, keep);
        retain_where(&mut self.b_factors, keep);
    }

    /// Leaves out residues with no atom37 atom (a residue of hydrogens only), as AlphaFold's
    /// `from_pdb_string` skips them.
    fn drop_residues_without_atoms(&mut self) {
        let keep: Vec<bool> = self.mask.iter().map(|m| m.iter().any(|&v| v > 0.5)).collect();
        self.retain(&keep);
    }

    /// Reads a PDB file (see [`Structure::parse`]).
    pub fn read(path: &Path, chain: Option<char>) -> Result<Structure> {
        let text = std::fs::read_to_string(path).map_err(|source| Error::Io { path: path.to_path_buf(), source })?;
        Structure::parse(&text, path, chain)
    }

    /// Writes the PDB file atomically, every residue in chain A; errors name `path`.
    pub fn write(&self, path: &Path) -> Result<()> {
        self.write_with_chains(path, &vec!['A'; self.aatype.len()])
    }

    /// Writes the PDB file atomically with each residue in chain `chains[i]`
    /// ([`Structure::to_pdb_with_chains`]); errors name `path`.
    pub fn write_with_chains(&self, path: &Path, chains: &[char]) -> Result<()> {
        let text = self.to_pdb_with_chains(chains).map_err(|msg| Error::Format { path: path.to_path_buf(), msg })?;
        data::write_atomic::<Error>(path, |w| {
            w.write_all(text.as_bytes()).map_err(|source| Error::Io { path: path.to_path_buf(), source })
        })
    }
}

/// Keeps the items of `v` whose entry in `keep` is true.
fn retain_where<T>(v: &mut Vec<T>, keep: &[bool]) {
    let mut k = keep.iter();
    v.retain(|_| *k.next().unwrap_or(&true));
}

/// Whether another location of an atom already read (`seen` its occupancy), at `occupancy`,
/// replaces it: Biopython's `DisorderedAtom`, which AlphaFold's PDB and mmCIF readers go
/// through, selects the most occupied location whatever its label, the first of equals. An
/// atom repeated without an alternative location label keeps the first. The template
/// (mmCIF) reader and the target (PDB) reader share this rule.
pub(crate) fn keeps_new_location(seen: f32, occupancy: f32, altloc: bool) -> bool {
    altloc && occupancy > seen
}

/// The resolution (Å) a PDB file's header gives (`REMARK   2 RESOLUTION.    2.00 ANGSTROMS.`):
/// 0 for `NOT APPLICABLE` (NMR, as AlphaFold's data pipeline gives a structure without one),
/// `None` without that remark or with another value.
pub fn resolution(text: &str) -> Option<f64> {
    let line = text.lines().find(|l| l.starts_with("REMARK   2") && l.contains("RESOLUTION."))?;
    let value = line.split_once("RESOLUTION.")?.1.split_whitespace().next()?;
    match value {
        "NOT" => Some(0.0),
        v => v.parse().ok().filter(|r: &f64| r.is_finite() && *r >= 0.0),
    }
}

/// [`resolution`] of the PDB file at `path`.
pub fn read_resolution(path: &Path) -> Result<Option<f64>> {
    let text = std::fs::read_to_string(path).map_err(|source| Error::Io { path: path.to_path_buf(), source })?;
    Ok(resolution(&text))
}

#[cfg(test)]
mod tests {
    use super::resolution;

    #[test]
    fn resolution_is_read_from_remark_2() {
        let header = |remark: &str| format!("HEADER    HYDROLASE\nREMARK   2\n{remark}\nATOM      1  N   MET A   1\n");
        assert_eq!(resolution(&header("REMARK   2 RESOLUTION.    1.74 ANGSTROMS.")), Some(1.74));
        assert_eq!(resolution(&header("REMARK   2 RESOLUTION. NOT APPLICABLE.")), Some(0.0), "NMR");
        assert_eq!(resolution(&header("REMARK   2 RESOLUTION. NULL")), None);
        assert_eq!(resolution("ATOM      1  N   MET A   1\n"), None);
    }
}
