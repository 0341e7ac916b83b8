//! The parts of a PDB mmCIF entry that template featurisation reads, as AlphaFold's
//! `mmcif_parsing.parse` reads them: the protein chains (entities of `_entity_poly_seq` with a
//! peptide monomer in `_chem_comp`, their instances in `_struct_asym`), each chain's SEQRES
//! (one letter per `_entity_poly_seq` monomer, `X` for anything but the 20 standard residues),
//! keyed by the author chain id; the first model's atoms (`_atom_site`) mapped onto SEQRES
//! positions through `label_seq_id`; the release date (the oldest
//! `_pdbx_audit_revision_history.revision_date`); and the resolution, which training reads.
use std::collections::HashMap;
use std::path::Path;

use data::{Error, Result};

use crate::residue_constants::{atom_order, residue_atom_order, ATOM_TYPE_NUM};

/// Three-letter codes of the 20 standard residues and their letters.
const THREE_TO_ONE: [(&str, char); 20] = [
    ("ALA", 'A'),
    ("CYS", 'C'),
    ("ASP", 'D'),
    ("GLU", 'E'),
    ("PHE", 'F'),
    ("GLY", 'G'),
    ("HIS", 'H'),
    ("ILE", 'I'),
    ("LYS", 'K'),
    ("LEU", 'L'),
    ("MET", 'M'),
    ("ASN", 'N'),
    ("PRO", 'P'),
    ("GLN", 'Q'),
    ("ARG", 'R'),
    ("SER", 'S'),
    ("THR", 'T'),
    ("VAL", 'V'),
    ("TRP", 'W'),
    ("TYR", 'Y'),
];

/// One atom of the structure.
#[derive(Clone, Debug, PartialEq)]
pub struct Atom {
    /// `label_atom_id`.
    pub name: String,
    /// Coordinates in Å (single precision, as the files' 3 decimals need).
    pub position: [f32; 3],
}

/// A structure residue: its name and atoms (one per atom name: of alternative locations the
/// one with the highest occupancy, the first of equals).
#[derive(Clone, Debug, PartialEq)]
pub struct Residue {
    /// `label_comp_id`.
    pub name: String,
    /// The atoms in file order.
    pub atoms: Vec<Atom>,
}

/// One protein chain.
#[derive(Clone, Debug, PartialEq)]
pub struct Chain {
    /// The author chain id (`auth_asym_id`), which pdb70 names hits by.
    pub id: String,
    /// SEQRES, one letter per residue.
    pub sequence: String,
    /// SEQRES as the file names it: each residue's `_entity_poly_seq.mon_id` (`MSE`, `SEP`).
    pub monomers: Vec<String>,
    /// For each SEQRES position, the structure residue (`None` where it was not observed).
    pub residues: Vec<Option<Residue>>,
}

/// A parsed entry.
#[derive(Clone, Debug, PartialEq)]
pub struct Mmcif {
    /// The oldest revision date, `YYYY-MM-DD` (`None` when the file has none).
    pub release_date: Option<String>,
    /// The protein chains, in the order of their entities.
    pub chains: Vec<Chain>,
    /// The resolution in Å, as AlphaFold's `_get_header` reads it: the first of
    /// `_refine.ls_d_res_high`, `_em_3d_reconstruction.resolution` and
    /// `_reflns.d_resolution_high` that is a number; 0 when none is (NMR entries).
    pub resolution: f64,
}

impl Chain {
    /// Each SEQRES residue's atoms in the 37 atom types, zero with mask 0 where absent, as
    /// AlphaFold's `_get_atom_positions` places them for templates and OpenFold's
    /// `get_atom_coords` for training targets: the selenium of a selenomethionine as SD;
    /// arginine's NH1 and NH2 named so that NH1 is the one nearer CD; other atoms (hydrogens)
    /// left out.
    pub fn atom37(&self) -> (Vec<[[f32; 3]; ATOM_TYPE_NUM]>, Vec<[f32; ATOM_TYPE_NUM]>) {
        let order = |name: &str| atom_order(name).expect("atom37 name");
        let (cd, nh1, nh2) = (order("CD"), order("NH1"), order("NH2"));
        let mut positions = Vec::with_capacity(self.residues.len());
        let mut masks = Vec::with_capacity(self.residues.len());
        for residue in &self.residues {
            let mut pos = [[0.0f32; 3]; ATOM_TYPE_NUM];
            let mut mask = [0.0f32; ATOM_TYPE_NUM];
            if let Some(res) = residue {
                for atom in &res.atoms {
                    if let Some(k) = residue_atom_order(&res.name, &atom.name) {
                        pos[k] = atom.position;
                        mask[k] = 1.0;
                    }
                }
                let dist = |a: [f32; 3], b: [f32; 3]| {
                    ((a[0] - b[0]).powi(2) + (a[1] - b[1]).powi(2) + (a[2] - b[2]).powi(2)).sqrt()
                };
                if res.name == "ARG"
                    && mask[cd] > 0.0
                    && mask[nh1] > 0.0
                    && mask[nh2] > 0.0
                    && dist(pos[nh1], pos[cd]) > dist(pos[nh2], pos[cd])
                {
                    pos.swap(nh1, nh2);
                    mask.swap(nh1, nh2);
                }
            }
            positions.push(pos);
            masks.push(mask);
        }
        (positions, masks)
    }
}

impl Mmcif {
    /// The chain with author id `id`.
    pub fn chain(&self, id: &str) -> Option<&Chain> {
        self.chains.iter().find(|c| c.id == id)
    }
}

/// Reads and parses the mmCIF file `path`.
pub fn read(path: &Path) -> Result<Mmcif> {
    let text =
        std::fs::read_to_string(path).map_err(|e| Error::Format { path: path.to_path_buf(), msg: e.to_string() })?;
    parse(&text, path)
}

/// Parses mmCIF text; `source` names it in errors.
pub fn parse(text: &str, source: &Path) -> Result<Mmcif> {
    let bad = |msg: String| Error::Format { path: source.to_path_buf(), msg };
    let items = items(text).map_err(|(line, msg)| bad(format!("line {line}: {msg}")))?;
    let column = |key: &str| -> Result<&Vec<String>> {
        items.get(key).ok_or_else(|| bad(format!("no {key} (needed for template features)")))
    };

    // Protein entities and their chains (label_asym_id).
    let (ent_ids, mon_ids, nums) =
        (column("_entity_poly_seq.entity_id")?, column("_entity_poly_seq.mon_id")?, column("_entity_poly_seq.num")?);
    let chem_types: HashMap<&str, &str> = column("_chem_comp.id")?
        .iter()
        .zip(column("_chem_comp.type")?)
        .map(|(id, t)| (id.as_str(), t.as_str()))
        .collect();
    let mut entities: Vec<(&str, Vec<(&str, i64)>)> = Vec::new();
    for ((entity, mon), num) in ent_ids.iter().zip(mon_ids).zip(nums) {
        let num = num.parse().map_err(|_| bad(format!("_entity_poly_seq.num {num:?} is not a number")))?;
        match entities.iter_mut().find(|(e, _)| e == entity) {
            Some((_, seq)) => seq.push((mon, num)),
            None => entities.push((entity, vec![(mon, num)])),
        }
    }
    let asym_ids = column("_struct_asym.id")?;
    let asym_entities = column("_struct_asym.entity_id")?;
    // (label_asym_id, monomers) of every protein chain.
    let mut protein: Vec<(&str, &[(&str, i64)])> = Vec::new();
    for (entity, seq) in &entities {
        let mut peptide = false;
        for (mon, _) in seq {
            let t = chem_types.get(mon).ok_or_else(|| bad(format!("monomer {mon} is not in _chem_comp")))?;
            peptide |= t.to_lowercase().contains("peptide");
        }
        if peptide {
            for (asym, _) in asym_ids.iter().zip(asym_entities).filter(|(_, e)| e == entity) {
                protein.push((asym, seq));
            }
        }
    }
    if protein.is_empty() {
        return Err(bad("no protein chains".into()));
    }

    // The first model's atoms.
    let site = |k: &str| column(&format!("_atom_site.{k}"));
    let (group, comp, atom_name, label_asym, auth_asym) = (
        site("group_PDB")?,
        site("label_comp_id")?,
        site("label_atom_id")?,
        site("label_asym_id")?,
        site("auth_asym_id")?,
    );
    let (label_seq, auth_seq, ins_code, model) =
        (site("label_seq_id")?, site("auth_seq_id")?, site("pdbx_PDB_ins_code")?, site("pdbx_PDB_model_num")?);
    let (xs, ys, zs) = (site("Cartn_x")?, site("Cartn_y")?, site("Cartn_z")?);
    let alt = items.get("_atom_site.label_alt_id");
    let occupancy = items.get("_atom_site.occupancy");
    let first_model = model.first().cloned().unwrap_or_default();
    let number = |v: &str, what: &str| -> Result<f32> {
        v.parse::<f32>()
            .ok()
            .filter(|x| x.is_finite())
            .ok_or_else(|| bad(format!("_atom_site.{what} {v:?} is not a finite number")))
    };
    // Structure residues by (author chain, hetero flag, author number, insertion code):
    // residue name and atoms with their occupancy and alternative location.
    type Key = (String, String, i64, String);
    let mut structure: HashMap<Key, (String, Vec<(Atom, f32)>)> = HashMap::new();
    let mut author_of: HashMap<&str, &str> = HashMap::new();
    // (label_asym_id, seqres index) -> residue key.
    let mut seq_to_structure: HashMap<(&str, usize), Key> = HashMap::new();
    for i in 0..group.len() {
        if model[i] != first_model {
            continue;
        }
        let hetflag = match (group[i].as_str(), comp[i].as_str()) {
            ("HETATM", "HOH" | "WAT") => "W".to_string(),
            ("HETATM", name) => format!("H_{name}"),
            _ => " ".to_string(),
        };
        let icode = if matches!(ins_code[i].as_str(), "." | "?") { " " } else { ins_code[i].as_str() };
        let resnum: i64 = auth_seq[i]
            .parse()
            .map_err(|_| bad(format!("_atom_site.auth_seq_id {:?} is not a number", auth_seq[i])))?;
        let key: Key = (auth_asym[i].clone(), hetflag, resnum, icode.to_string());
        author_of.insert(&label_asym[i], &auth_asym[i]);
        if let Some((_, seq)) = protein.iter().find(|(a, _)| *a == label_asym[i]) {
            let start = seq.iter().map(|m| m.1).min().unwrap_or(0);
            let idx = label_seq[i]
                .parse::<i64>()
                .map_err(|_| bad(format!("_atom_site.label_seq_id {:?} is not a number", label_seq[i])))?
                - start;
            let idx = usize::try_from(idx)
                .map_err(|_| bad(format!("_atom_site.label_seq_id {} before SEQRES", label_seq[i])))?;
            seq_to_structure.insert((&label_asym[i], idx), key.clone());
        }
        let atom = Atom {
            name: atom_name[i].clone(),
            position: [number(&xs[i], "Cartn_x")?, number(&ys[i], "Cartn_y")?, number(&zs[i], "Cartn_z")?],
        };
        let occ = match occupancy {
            Some(o) => o[i].parse().unwrap_or(1.0),
            None => 1.0,
        };
        let altloc = alt.is_some_and(|a| !matches!(a[i].as_str(), "." | "?"));
        let (_, atoms) = structure.entry(key).or_insert_with(|| (comp[i].clone(), Vec::new()));
        match atoms.iter_mut().find(|(a, _)| a.name == atom.name) {
            // Another location of an atom seen: keep the more occupied one.
            Some(seen) if crate::pdb::keeps_new_location(seen.1, occ, altloc) => *seen = (atom, occ),
            Some(_) => {}
            None => atoms.push((atom, occ)),
        }
    }

    let mut chains: Vec<Chain> = Vec::new();
    for (asym, seq) in &protein {
        let author =
            author_of.get(asym).ok_or_else(|| bad(format!("protein chain {asym} has no atoms in _atom_site")))?;
        let sequence: String = seq
            .iter()
            .map(|(mon, _)| THREE_TO_ONE.iter().find(|(three, _)| three == mon).map_or('X', |(_, one)| *one))
            .collect();
        let residues = (0..seq.len())
            .map(|idx| {
                seq_to_structure.get(&(*asym, idx)).and_then(|key| structure.get(key)).map(|(name, atoms)| Residue {
                    name: name.clone(),
                    atoms: atoms.iter().map(|(a, _)| a.clone()).collect(),
                })
            })
            .collect();
        let monomers = seq.iter().map(|(mon, _)| mon.to_string()).collect();
        let chain = Chain { id: author.to_string(), sequence, monomers, residues };
        // Two label chains of one author chain: the later one wins, as in AlphaFold's dict.
        match chains.iter_mut().find(|c| c.id == chain.id) {
            Some(c) => *c = chain,
            None => chains.push(chain),
        }
    }
    let release_date = items.get("_pdbx_audit_revision_history.revision_date").and_then(|d| d.iter().min().cloned());
    Ok(Mmcif { release_date, chains, resolution: resolution(&items) })
}

/// The keys AlphaFold's `_get_header` reads the resolution from, in its order.
const RESOLUTION_KEYS: [&str; 3] =
    ["_refine.ls_d_res_high", "_em_3d_reconstruction.resolution", "_reflns.d_resolution_high"];

/// The first of [`RESOLUTION_KEYS`] whose first value is a number (`?` and `.` are not), else
/// 0, as AlphaFold's header defaults it.
fn resolution(items: &HashMap<String, Vec<String>>) -> f64 {
    RESOLUTION_KEYS
        .iter()
        .filter_map(|k| items.get(*k)?.first()?.parse::<f64>().ok())
        .find(|r| r.is_finite())
        .unwrap_or(0.0)
}

/// The data items of the first data block: each tag's values (one for a plain item, one per
/// row for a loop column). Errors are (line, message).
fn items(text: &str) -> std::result::Result<HashMap<String, Vec<String>>, (usize, String)> {
    let tokens = tokens(text)?;
    let mut items: HashMap<String, Vec<String>> = HashMap::new();
    let mut i = 0;
    let mut blocks = 0;
    while i < tokens.len() {
        let (line, ref tok, quoted) = tokens[i];
        if !quoted && tok.starts_with("data_") {
            blocks += 1;
            if blocks > 1 {
                break;
            }
            i += 1;
        } else if !quoted && tok == "loop_" {
            let mut tags = Vec::new();
            i += 1;
            while i < tokens.len() && !tokens[i].2 && tokens[i].1.starts_with('_') {
                tags.push(tokens[i].1.clone());
                i += 1;
            }
            if tags.is_empty() {
                return Err((line, "loop_ without tags".into()));
            }
            let mut values = Vec::new();
            while i < tokens.len() && (tokens[i].2 || !is_keyword(&tokens[i].1)) {
                values.push(tokens[i].1.clone());
                i += 1;
            }
            if values.len() % tags.len() != 0 {
                return Err((
                    line,
                    format!("loop of {} tags ({}...) has {} values, not a multiple", tags.len(), tags[0], values.len()),
                ));
            }
            for (k, tag) in tags.iter().enumerate() {
                items.insert(tag.clone(), values.iter().skip(k).step_by(tags.len()).cloned().collect());
            }
        } else if !quoted && tok.starts_with('_') {
            let value = tokens.get(i + 1).filter(|t| t.2 || !is_keyword(&t.1));
            let value = value.ok_or_else(|| (line, format!("{tok} has no value")))?;
            items.insert(tok.clone(), vec![value.1.clone()]);
            i += 2;
        } else {
            return Err((line, format!("unexpected value {tok:?} outside a loop")));
        }
    }
    if blocks == 0 {
        return Err((1, "no data_ block (not an mmCIF file)".into()));
    }
    Ok(items)
}

/// Whether an unquoted token is a tag or keyword rather than a value.
fn is_keyword(tok: &str) -> bool {
    tok.starts_with('_') || tok == "loop_" || tok.starts_with("data_") || tok.starts_with("save_") || tok == "global_"
}

/// A CIF token: its line, its text, whether it was quoted (a quoted `_x` is a value).
type Token = (usize, String, bool);

/// The tokens of CIF text: (line, text, quoted). Comments (`#` to the end of the line) are
/// dropped; `'...'` and `"..."` end at a matching quote followed by a blank; a line starting
/// with `;` opens a text field that the next such line closes.
fn tokens(text: &str) -> std::result::Result<Vec<Token>, (usize, String)> {
    let mut out = Vec::new();
    let mut lines = text.lines().enumerate().map(|(i, l)| (i + 1, l));
    while let Some((n, line)) = lines.next() {
        if let Some(first) = line.strip_prefix(';') {
            let mut field = first.to_string();
            loop {
                let Some((_, next)) = lines.next() else { return Err((n, "text field (;) not closed".into())) };
                if next.starts_with(';') {
                    break;
                }
                field.push('\n');
                field.push_str(next);
            }
            out.push((n, field.trim().to_string(), true));
            continue;
        }
        let b = line.as_bytes();
        let mut i = 0;
        while i < b.len() {
            match b[i] {
                b' ' | b'\t' => i += 1,
                b'#' => break,
                q @ (b'\'' | b'"') => {
                    let mut j = i + 1;
                    while j < b.len() && !(b[j] == q && (j + 1 == b.len() || b[j + 1] == b' ' || b[j + 1] == b'\t')) {
                        j += 1;
                    }
                    if j >= b.len() {
                        return Err((n, "quoted value not closed".into()));
                    }
                    out.push((n, line[i + 1..j].to_string(), true));
                    i = j + 1;
                }
                _ => {
                    let j = line[i..].find([' ', '\t']).map_or(b.len(), |k| i + k);
                    out.push((n, line[i..j].to_string(), false));
                    i = j;
                }
            }
        }
    }
    Ok(out)
}
