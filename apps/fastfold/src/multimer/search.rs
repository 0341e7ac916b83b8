//! AlphaFold-Multimer's searches for a complex (`pipeline_multimer.DataPipeline`): each
//! entity's first chain searched as a monomer is (jackhmmer against UniRef90 and MGnify,
//! hhblits or the small BFD, templates), its alignments saved in `<msas>/<chain id>/` (`A/`,
//! `B/`, ...; AlphaFold's layout), and, when the complex has several entities, jackhmmer against
//! UniProt for the rows paired across chains (`uniprot_hits.sto`). With
//! `--use-precomputed-msas` each chain's saved alignments are read back.
use std::path::Path;

use anyhow::Context;

use super::complex::Complex;
use super::features::{EntityInput, PairingMsa};
use crate::features::RawFeatures;
use crate::search::{Mode, Search, UNIPROT_FILE};

/// Each entity's inputs for [`super::features()`], in entity order, by `search` (and UniProt at
/// `uniprot` for a complex of several entities; not needed with [`Mode::ReadSaved`]),
/// alignments under `msas`; `mode` as for [`Search::run`]. Also writes AlphaFold's `chain_id_map.json` in `msas` (when searching).
pub fn entity_inputs(
    complex: &Complex,
    search: &Search,
    uniprot: Option<&Path>,
    msas: &Path,
    mode: Mode,
) -> anyhow::Result<Vec<EntityInput>> {
    if mode == Mode::Search {
        std::fs::create_dir_all(msas).with_context(|| format!("creating {}", msas.display()))?;
        let map = msas.join("chain_id_map.json");
        data::write_atomic(&map, |w| -> anyhow::Result<()> {
            Ok(std::io::Write::write_all(w, complex.chain_id_map_json().as_bytes())?)
        })
        .with_context(|| format!("writing {}", map.display()))?;
    }
    let pair = !complex.is_homomer_or_monomer();
    if pair && uniprot.is_none() && mode == Mode::Search {
        anyhow::bail!("the complex has several distinct chains: pairing their rows needs --uniprot-database-path (or --data-dir with uniprot/uniprot.fasta)")
    }
    // Reading saved alignments only, the UniProt database is not read (a missing
    // `uniprot_hits.sto` is an error naming it).
    let uniprot = uniprot.unwrap_or(Path::new(""));
    complex
        .entity_representatives()
        .into_iter()
        .map(|chain| {
            let dir = msas.join(chain.id.to_string());
            let name = format!("chain_{}", chain.id);
            let what = || format!("chain {} ({})", chain.id, chain.record);
            let found = search.run(&name, &chain.sequence, &dir, mode).with_context(what)?;
            let raw = RawFeatures::new(&chain.sequence, Some((&found.msa, &dir))).with_context(what)?;
            let raw = RawFeatures { templates: found.templates, ..raw };
            let pairing = match pair {
                true => {
                    let msa = search.uniprot(&name, &chain.sequence, uniprot, &dir, mode).with_context(what)?;
                    Some(PairingMsa::new(&chain.sequence, &msa, &dir.join(UNIPROT_FILE)).with_context(what)?)
                }
                false => None,
            };
            Ok(EntityInput { raw, pairing })
        })
        .collect()
}
