//! Row-major two-dimensional arrays and the four ways AlphaFold-Multimer's pipeline combines
//! them: picking rows, stacking rows (`np.concatenate(axis=0)`), joining columns
//! (`axis=1`), and the block-diagonal arrangement with a fill value (`msa_pairing.block_diag`).
//! An array with more dimensions is a grid whose row holds the rest (`[T, N, 37]` as T rows of
//! N * 37), so joining along residues is joining columns.

/// `rows` x `cols` values, row by row.
#[derive(Clone, Debug, PartialEq)]
pub struct Grid<T> {
    /// Number of rows.
    pub rows: usize,
    /// Number of columns.
    pub cols: usize,
    /// The values, row-major.
    pub data: Vec<T>,
}

impl<T: Copy> Grid<T> {
    /// The grid of these rows, each `cols` long.
    pub fn from_rows(rows: impl IntoIterator<Item = Vec<T>>, cols: usize) -> Grid<T> {
        let mut data = Vec::new();
        let mut n = 0;
        for r in rows {
            assert_eq!(r.len(), cols, "a grid row of {} values, expected {cols}", r.len());
            data.extend(r);
            n += 1;
        }
        Grid { rows: n, cols, data }
    }

    /// `rows` x `cols` of `value`.
    pub fn filled(rows: usize, cols: usize, value: T) -> Grid<T> {
        Grid { rows, cols, data: vec![value; rows * cols] }
    }

    /// Row `i`.
    pub fn row(&self, i: usize) -> &[T] {
        &self.data[i * self.cols..(i + 1) * self.cols]
    }

    /// Every row in order.
    pub fn iter_rows(&self) -> impl Iterator<Item = &[T]> {
        (0..self.rows).map(move |i| self.row(i))
    }

    /// The rows at `indices`, in that order.
    pub fn select(&self, indices: &[usize]) -> Grid<T> {
        Grid {
            rows: indices.len(),
            cols: self.cols,
            data: indices.iter().flat_map(|&i| self.row(i)).copied().collect(),
        }
    }

    /// The first `n` rows (all of them if there are fewer).
    pub fn head(&self, n: usize) -> Grid<T> {
        let n = n.min(self.rows);
        Grid { rows: n, cols: self.cols, data: self.data[..n * self.cols].to_vec() }
    }

    /// The grid with `value` rows added below, up to `rows` rows.
    pub fn pad_rows(&self, rows: usize, value: T) -> Grid<T> {
        let mut data = self.data.clone();
        data.resize(rows.max(self.rows) * self.cols, value);
        Grid { rows: rows.max(self.rows), cols: self.cols, data }
    }

    /// The grids one below the other (the same width).
    pub fn vstack(parts: &[&Grid<T>]) -> Grid<T> {
        let cols = parts.first().map_or(0, |g| g.cols);
        assert!(parts.iter().all(|g| g.cols == cols), "stacked grids differ in width");
        Grid {
            rows: parts.iter().map(|g| g.rows).sum(),
            cols,
            data: parts.iter().flat_map(|g| g.data.iter().copied()).collect(),
        }
    }

    /// The grids side by side (the same height): row i is every grid's row i in turn.
    pub fn hstack(parts: &[&Grid<T>]) -> Grid<T> {
        let rows = parts.first().map_or(0, |g| g.rows);
        assert!(parts.iter().all(|g| g.rows == rows), "joined grids differ in height");
        let data = (0..rows).flat_map(|i| parts.iter().flat_map(move |g| g.row(i).iter().copied())).collect();
        Grid { rows, cols: parts.iter().map(|g| g.cols).sum(), data }
    }

    /// The grids along the diagonal, `fill` everywhere else (`msa_pairing.block_diag`).
    pub fn block_diag(parts: &[&Grid<T>], fill: T) -> Grid<T> {
        let cols: usize = parts.iter().map(|g| g.cols).sum();
        let mut out = Grid::filled(parts.iter().map(|g| g.rows).sum(), cols, fill);
        let (mut r0, mut c0) = (0, 0);
        for g in parts {
            for i in 0..g.rows {
                let at = (r0 + i) * cols + c0;
                out.data[at..at + g.cols].copy_from_slice(g.row(i));
            }
            r0 += g.rows;
            c0 += g.cols;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stacking_joining_and_the_block_diagonal() {
        let a = Grid::from_rows([vec![1, 2], vec![3, 4]], 2);
        let b = Grid::from_rows([vec![5]], 1);
        let empty = Grid::<i32>::filled(0, 3, 0);
        assert_eq!(Grid::hstack(&[&a, &Grid::from_rows([vec![7], vec![8]], 1)]).data, [1, 2, 7, 3, 4, 8]);
        assert_eq!(Grid::vstack(&[&a, &Grid::from_rows([vec![9, 9]], 2)]).rows, 3);
        // A block without rows still takes its columns, as scipy's block_diag does.
        let d = Grid::block_diag(&[&a, &empty, &b], -1);
        assert_eq!((d.rows, d.cols), (3, 6));
        assert_eq!(d.data, [1, 2, -1, -1, -1, -1, 3, 4, -1, -1, -1, -1, -1, -1, -1, -1, -1, 5]);
        assert_eq!(a.select(&[1, 1, 0]).data, [3, 4, 3, 4, 1, 2]);
        assert_eq!(a.head(5), a);
        assert_eq!(b.pad_rows(3, 0).data, [5, 0, 0]);
    }
}
