//! Which UniProt rows of the chains go together, as AlphaFold's `msa_pairing.pair_sequences`
//! and `reorder_paired_rows` decide: rows are grouped by species in each chain; a species
//! found in two chains or more, with at most 600 rows in each, pairs its rows across them, most
//! similar to each chain's query first (the fraction of columns equal to row 0; ties keep the
//! alignment's order), as many as the chain with the fewest has, chains without the species
//! taking their gap row. The queries are always paired first; then pairings across every
//! chain, then across one chain fewer, and so on, each group in ascending order of the
//! absolute product of its row numbers (ties keep the species' alphabetical order).
use std::collections::{BTreeMap, BTreeSet};

use super::grid::Grid;

/// Species with more rows than this in any chain are not paired (`pair_sequences`).
pub const MAX_ROWS_PER_SPECIES: usize = 600;

/// The row of each chain's pairing MSA in each paired row, in order: row 0 the queries; `None`
/// is the gap row (the chain has no row of that species).
pub fn paired_rows(msas: &[&Grid<i32>], species: &[&[String]]) -> Vec<Vec<Option<usize>>> {
    let n = msas.len();
    let by_species: Vec<BTreeMap<&str, Vec<usize>>> = species
        .iter()
        .map(|ids| {
            let mut map: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
            for (row, id) in ids.iter().enumerate() {
                map.entry(id.as_str()).or_default().push(row);
            }
            map
        })
        .collect();
    let common: BTreeSet<&str> = by_species.iter().flat_map(|m| m.keys().copied()).filter(|s| !s.is_empty()).collect();
    // Pairings by the number of chains they join (0..=n; 1 and 0 stay empty).
    let mut by_count: Vec<Vec<Vec<Option<usize>>>> = vec![Vec::new(); n + 1];
    by_count[n].push(vec![Some(0); n]);
    for s in common {
        let rows: Vec<Option<&Vec<usize>>> = by_species.iter().map(|m| m.get(s)).collect();
        let present: Vec<usize> = rows.iter().flatten().map(|r| r.len()).collect();
        if present.len() <= 1 || present.iter().any(|&k| k > MAX_ROWS_PER_SPECIES) {
            continue;
        }
        let take = present.iter().copied().min().unwrap_or(0);
        let best: Vec<Option<Vec<usize>>> =
            rows.iter().zip(msas).map(|(r, msa)| r.map(|r| most_similar(msa, r, take))).collect();
        for k in 0..take {
            by_count[present.len()].push(best.iter().map(|b| b.as_ref().map(|b| b[k])).collect());
        }
    }
    let mut out = Vec::new();
    for mut group in by_count.into_iter().rev() {
        // numpy's int64 product, wrapping as it does, and its absolute value.
        group.sort_by_key(|rows| {
            rows.iter().fold(1i64, |p, r| p.wrapping_mul(r.map_or(-1, |r| r as i64))).wrapping_abs()
        });
        out.extend(group);
    }
    out
}

/// The `take` rows of `rows` most similar to `msa`'s row 0, best first, ties in order.
fn most_similar(msa: &Grid<i32>, rows: &[usize], take: usize) -> Vec<usize> {
    let query = msa.row(0);
    let same = |r: usize| msa.row(r).iter().zip(query).filter(|(a, b)| a == b).count();
    let mut sorted = rows.to_vec();
    sorted.sort_by_key(|&r| std::cmp::Reverse(same(r)));
    sorted.truncate(take);
    sorted
}

/// The rows of `msa` not among `paired`'s rows (`deduplicate_unpaired_sequences`).
pub fn unpaired_rows(msa: &Grid<i32>, paired: &Grid<i32>) -> Vec<usize> {
    let seen: std::collections::HashSet<&[i32]> = paired.iter_rows().collect();
    (0..msa.rows).filter(|&i| !seen.contains(msa.row(i))).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(s: &[&str]) -> Vec<String> {
        s.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn species_pair_best_first_and_groups_go_by_chain_count_then_row_product() {
        // Chain 0: query 0 1 2 3; two HUMAN rows (row 2 closer), one MOUSE, one YEAST.
        let a =
            Grid::from_rows([vec![0, 1, 2, 3], vec![0, 9, 9, 9], vec![0, 1, 2, 9], vec![0, 1, 9, 9], vec![9; 4]], 4);
        let sa = ids(&["", "HUMAN", "HUMAN", "MOUSE", "YEAST"]);
        // Chain 1: one HUMAN, a YEAST; chain 2: MOUSE twice, HUMAN.
        let b = Grid::from_rows([vec![5, 5], vec![5, 5], vec![5, 0]], 2);
        let sb = ids(&["", "HUMAN", "YEAST"]);
        let c = Grid::from_rows([vec![7], vec![1], vec![7], vec![7]], 1);
        let sc = ids(&["", "MOUSE", "MOUSE", "HUMAN"]);
        let rows = paired_rows(&[&a, &b, &c], &[&sa, &sb, &sc]);
        let s = |v: &[i64]| v.iter().map(|&r| usize::try_from(r).ok()).collect::<Vec<_>>();
        assert_eq!(
            rows,
            [
                s(&[0, 0, 0]),
                s(&[2, 1, 3]),  // HUMAN in all three: the closest of chain 0's two.
                s(&[3, -1, 2]), // MOUSE in two: chain 2's row equal to its query; |3 * -1 * 2| = 6 ...
                s(&[4, 2, -1]), // ... before YEAST's |4 * 2 * -1| = 8.
            ]
        );
        // One species over the row limit in any chain is not paired.
        let many = Grid::filled(MAX_ROWS_PER_SPECIES + 2, 1, 0);
        let mut sm = ids(&["HUMAN"; MAX_ROWS_PER_SPECIES + 2]);
        sm[0].clear();
        let one = Grid::filled(2, 1, 0);
        let so = ids(&["", "HUMAN"]);
        assert_eq!(paired_rows(&[&many, &one], &[&sm, &so]), [s(&[0, 0])]);
        assert_eq!(unpaired_rows(&a, &a.select(&[0, 3])), [1, 2, 4]);
    }
}
